import json

from conftest import ROOT, torchrun


def test_tensor_group_collectives_take_device_tensors(tmp_path, tiny_models):
    """The trainer's collectives on its group (NCCL on GPU) are handed no tensor that would be on the host
    there; see tests/workers/collective_devices.py for how a CPU run tells the two apart."""
    policy, _ = tiny_models
    torchrun(ROOT / "tests/workers/collective_devices.py", policy, tmp_path)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # the checker flags exactly the snippets that fail on GPU
        assert all(expected == flagged for expected, flagged in result["self_check"].values()), result["self_check"]
        # it saw the trainer's own collectives and FSDP's, on the world's group and on a train group of one
        assert {"all_reduce", "all_gather_single", "reduce_scatter_single"} <= set(result["checked"])
        assert result["problems"] == [], result["problems"]
