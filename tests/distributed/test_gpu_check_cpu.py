"""bench/gpu_check.py's checks that need no CUDA, on two CPU ranks (without CUDA the script itself stops
at once: tests/unit/test_gpu_check.py)."""
import json

from conftest import ROOT, torchrun


def test_its_checks_pass_on_cpu_where_they_need_no_cuda(tmp_path, tiny_models):
    policy, _ = tiny_models
    torchrun(ROOT / "tests/workers/gpu_check_cpu.py", policy, tmp_path)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        checks = result["checks"]
        assert list(checks) == ["trainer", "publish", "train shift"]  # the device copy and CUDA IPC need CUDA
        assert all(check["ok"] for check in checks.values()), result["lines"]
        assert checks["trainer"]["moved"] > 0 and checks["train shift"]["state_bytes"] > 0
        assert not result["engine_imported"]
