import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT, torchrun
from storage import plan_layout, shard_rows


def test_layout_is_aligned_and_disjoint():
    slots, total = plan_layout([("a", (3,), torch.float32), ("b", (5, 2), torch.bfloat16), ("c", (1,), torch.int64)])
    assert [s.offset % 64 for s in slots] == [0, 0, 0]
    ends = [s.offset + s.nbytes for s in slots]
    assert all(end <= nxt.offset for end, nxt in zip(ends, slots[1:]))
    assert slots[0].offset >= 8 and total >= ends[-1]


@pytest.mark.slow
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


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(0, 300), count=st.integers(1, 16))
def test_shard_rows_match_fsdp2s_chunking(rows, count):
    chunks = torch.arange(rows).chunk(count) if rows else ()
    for index in range(count):
        first, stop = shard_rows(rows, index, count)
        expected = chunks[index].tolist() if index < len(chunks) else []
        assert list(range(first, stop)) == expected


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [1, 2])
def test_sharded_publish_fills_every_node_replica(tmp_path, nodes):
    torchrun(ROOT / "tests/workers/storage_nodes.py", tmp_path, nodes)
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["node"] for r in results] == ([0, 0] if nodes == 1 else [0, 1])
    assert all(r["ok"] == [True, True] for r in results)


@pytest.mark.slow
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
