"""bench/gpu_check.py on a machine without CUDA: it stops at once and imports no vLLM (its checks that need
no CUDA, on two CPU ranks: tests/distributed/test_gpu_check_cpu.py)."""
import os
import subprocess
import sys

from conftest import ROOT

BLOCK_VLLM = "import sys; sys.modules['vllm'] = None; "  # any import of vllm then fails


def python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_it_stops_at_once_without_cuda_and_imports_no_vllm():
    run = python(BLOCK_VLLM + "sys.argv = ['gpu_check.py', '--json', 'unused.json']; import runpy; "
                 "runpy.run_path('bench/gpu_check.py', run_name='__main__')")
    assert run.returncode == 1
    assert run.stderr.strip().endswith("gpu_check: no CUDA device here (torch.cuda.is_available() is False); run "
                                       "it on a GPU machine with a CUDA build of torch"), run.stderr[-2000:]
    assert not (ROOT / "unused.json").exists()
    imported = python(BLOCK_VLLM + "import bench.gpu_check; print(sorted(name for name, module in sys.modules.items() "
                      "if module is not None and name.startswith(('roles', 'shifting', 'storage', 'vllm'))))")
    assert imported.returncode == 0, imported.stderr[-2000:]
    assert imported.stdout.split("\n")[-2] == "['roles', 'roles.trainer', 'shifting', 'shifting.book', 'shifting.context', 'storage']"
