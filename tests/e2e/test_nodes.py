"""A run on two nodes is the run on one node of the same world size: two torchrun agents on this machine,
one rank each, give the per-step rewards, the eval accuracy and the final training state, bit for bit, of
one node of two ranks with the same flags. Across nodes the storage's rows travel over gloo here (NCCL on
GPU nodes), and checkpoints are restored into every node's replica."""
import shutil

from conftest import SMALL_STEPS, metrics, same_run, small_run


def crossed_nodes(out) -> list[int]:
    """Bytes the training-state saves sent between nodes, per step."""
    return [r["storage"]["train_state"]["bytes_across_nodes"] for r in metrics(out) if "storage" in r]


def shifts(out) -> list[tuple]:
    return [(s["rank"], s["from"], s["to"]) for r in metrics(out) for s in r.get("shifts", [])]


def test_two_nodes_colocated_stopped_and_resumed_end_as_one_node(uninterrupted, tmp_path):
    out, one = tmp_path / "two", uninterrupted("colocated")[0]
    small_run(out, "colocated", steps=1, nodes=2)
    small_run(out, "colocated", nodes=2)  # each node's writer restores its replica from the shared --out
    assert (out / "checkpoints/LATEST").read_text() == f"step-{SMALL_STEPS:06d}"
    same_run(one, out)
    assert all(crossed_nodes(out)) and not any(crossed_nodes(one))


def test_two_nodes_with_forced_shifts_end_as_one_node(uninterrupted, tmp_path):
    out, one = tmp_path / "two", uninterrupted("forced")[0]
    small_run(out, "forced", nodes=2)
    same_run(one, out)
    assert shifts(out) == shifts(one) and all(crossed_nodes(out))


def test_nodes_that_see_different_checkpoints_stop(uninterrupted, tmp_path):
    """--out on a filesystem each node has for itself: node 1 finds no checkpoint where node 0 finds one."""
    shared, alone = tmp_path / "shared", tmp_path / "alone"
    shutil.copytree(uninterrupted("colocated")[0], shared)
    agents = small_run(shared, "colocated", nodes=2, node_args={1: ["--out", alone]}, check=False)
    for agent in agents:
        assert agent.returncode != 0
        assert "--out must be on a filesystem every node shares" in agent.stdout, agent.stdout[-3000:]
