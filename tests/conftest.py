import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
POLICY, GENRM = ROOT / "models/arith-policy", ROOT / "models/arith-genrm"

# A small run of the built-in task: 3 steps of 16 samples, a checkpoint after each, evaluation at the start
# and the end. Placements whose samples and update depend on the seed alone, with their world sizes.
SMALL_STEPS = 3
SMALL = ["--prompts-per-step", 4, "--group-size", 4, "--eval-every", 100,
         "--eval-prompts", 8, "--checkpoint-every", 1]
PLACEMENTS = {
    "colocated": ([], 2),
    "pivot": (["--placement", "pivot"], 2),
    "forced": (["--placement", "pivot", "--force-shifts", 3, "--force-shift-rate", 0.3], 2),
    "disaggregated": (["--placement", "disaggregated", "--split", "rollout=1,genrm=1,train=1"], 3),
}
# vLLM warns of a VLLM_ variable it does not know, from the logger of a warning that roles/logs.py leaves
# out: a real warning, which a run's console must still show. OMP_NUM_THREADS set keeps torchrun's own note
# about it out of the console.
CONSOLE_ENV = {"VLLM_NOT_A_SETTING": "1", "OMP_NUM_THREADS": "1"}


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


def small_run(out, placement, **kw) -> subprocess.CompletedProcess:
    flags, nproc = PLACEMENTS[placement]
    steps = kw.pop("steps", SMALL_STEPS)
    return torchrun(ROOT / "pivot_train.py", *SMALL, "--steps", steps, "--out", out, *flags, nproc=nproc, **kw)


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """`uninterrupted(placement)`: (run directory, finished process) of the small run, made on first use
    and shared by every test of the session."""
    made = {}

    def get(placement):
        if placement not in made:
            out = tmp_path_factory.mktemp(placement) / "run"
            made[placement] = out, small_run(out, placement, env=CONSOLE_ENV)
        return made[placement]
    return get


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
