"""ParameterStorage on real ranks under torchrun: a node's local ranks share one copy, and every node's
replica holds exactly what was written (its layout and cuts alone: tests/unit/test_storage.py)."""
import json

import pytest

from conftest import ROOT, torchrun


def test_two_local_ranks_share_one_copy(tmp_path):
    """Every rank reads, for each version, the tensors the node's writer (rank 0) handed in, bit for bit,
    not its own: one copy per node."""
    from workers.storage_share import handed
    torchrun(ROOT / "tests/workers/storage_share.py", tmp_path)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert not result["name_left_in_shm"]  # unlinked once every local rank has mapped it
        assert [v["version"] for v in result["versions"]] == [1, 2]
        for version, seen in zip((1, 2), result["versions"]):
            writer, own = ({name: t.float().flatten().tolist() for name, t in handed(version, r)} for r in (0, rank))
            assert seen["tensors"] == writer and (rank == 0 or seen["tensors"] != own)


@pytest.mark.parametrize("nproc, nodes", [(2, 1), (2, 2), (3, 3), (4, 2)])
def test_every_replica_holds_exactly_what_was_written(tmp_path, nproc, nodes):
    """Publishes where every rank, one rank, a few rows or no rank write, on one node, on two and three
    one-rank nodes and on two nodes of two ranks: every replica bit-exact, and a row crosses to each other
    node once."""
    torchrun(ROOT / "tests/workers/storage_nodes.py", tmp_path, nodes, nproc=nproc)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(nproc)]
    local = nproc // nodes
    assert [r["node"] for r in ranks] == [rank // local for rank in range(nproc)]
    for r in ranks:
        assert [(p["what"], p["exact"], p["version_ok"]) for p in r["publishes"]] == \
            [(p["what"], True, True) for p in r["publishes"]]
    for p in (p for r in ranks for p in r["publishes"]):
        assert p["bytes"] == p["expected_bytes"] and p["bytes_across_nodes"] == p["bytes"] * (nodes - 1), p
    for i, p in enumerate(ranks[0]["publishes"]):  # what the nodes' own ranks wrote adds up to the publish
        assert sum(ranks[node * local]["publishes"][i]["bytes_local"] for node in range(nodes)) == p["bytes"]
    assert [p["bytes"] == 0 for p in ranks[0]["publishes"]] == [p["what"] == "no rank writes"
                                                               for p in ranks[0]["publishes"]]


def test_one_copy_per_node_whatever_the_local_ranks(tmp_path):
    """Resident memory of the storage summed over a node's ranks (Pss) is one copy, for 1 rank or 2."""
    totals = {}
    for nproc in (1, 2):
        out = tmp_path / str(nproc)
        out.mkdir()
        torchrun(ROOT / "tests/workers/storage_memory.py", out, 64, nproc=nproc)
        ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nproc)]
        copy_kb = ranks[0]["nbytes"] / 1024
        for r in ranks:
            assert r["Rss"] >= 0.95 * copy_kb  # each rank sees all of it...
        totals[nproc] = sum(r["Pss"] for r in ranks)  # ...but the node holds it once
        assert 0.95 * copy_kb <= totals[nproc] <= 1.05 * copy_kb
    print(f"storage resident memory per node: 1 rank {totals[1] / 1024:.1f} MiB, "
          f"2 ranks {totals[2] / 1024:.1f} MiB")
