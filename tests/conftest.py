import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
POLICY, GENRM = ROOT / "models/arith-policy", ROOT / "models/arith-genrm"


def torchrun(script, *args, nproc=2, timeout=600, restarts=0, env=None) -> subprocess.CompletedProcess:
    """Runs `script` under torchrun with real gloo process groups (`restarts`: torchrun's --max-restarts,
    `env`: extra environment); fails the test with the output's tail."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           f"--max-restarts={restarts}", str(script), *map(str, args)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n{(proc.stdout + proc.stderr)[-6000:]}")
    return proc


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> tuple[Path, Path]:
    """A policy and a judge made from a config (random weights), so no test needs a shipped model."""
    from tinymodel import make_model
    root = tmp_path_factory.mktemp("models")
    make_model(str(root / "policy"), init_std=0.2, seed=0)
    make_model(str(root / "genrm"), init_std=0.2, seed=1)
    return root / "policy", root / "genrm"


@pytest.fixture(scope="session")
def arch_models(tmp_path_factory) -> dict[str, Path]:
    """One tiny model of each architecture, of different sizes; qwen3's tokenizer has a chat template."""
    from tinymodel import make_model
    root = tmp_path_factory.mktemp("arch_models")
    shapes = {"qwen2": dict(hidden=128, layers=2), "llama": dict(hidden=192, layers=3),
              "qwen3": dict(hidden=128, layers=2, chat_template=True), "qwen3_moe": dict(hidden=128, layers=2)}
    for seed, (arch, shape) in enumerate(shapes.items()):
        make_model(str(root / arch), arch=arch, init_std=0.2, seed=seed, **shape)
    return {arch: root / arch for arch in shapes}
