import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
# What bench/placements.py --json wrote in a real run on this machine: the simulator's CPU cost model, and
# each placement's rounds (tests/unit/test_sim.py, test_replay.py; e2e/test_staleness.py)
BENCH_JSON = ROOT / "tests" / "data" / "placements_cpu.json"
sys.path.insert(0, str(ROOT))
POLICY, JUDGE = ROOT / "models/arith-policy", ROOT / "models/arith-genrm"
UNIT = ROOT / "tests/unit"


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by -m
def pytest_collection_modifyitems(items):
    """Every test outside unit/ (distributed/, e2e/) starts processes under torchrun: `slow` (pytest.ini)
    by its folder, so `-m "not slow"` selects unit/ alone and no test file writes the mark."""
    for item in items:
        if UNIT not in item.path.parents:
            item.add_marker(pytest.mark.slow)

@pytest.fixture
def book_calls(monkeypatch):
    """`book_calls(*names)`: replaces those rules of shifting/book.py by spies and returns the list their
    calls go to, each (the calling module, the rule, its arguments, its answer), so a test can tell that
    the loop and the simulator each decided by the book and not by a rule of their own."""
    from shifting import book

    def watch(*names):
        calls = []
        for name in names:
            def spy(*args, rule=getattr(book, name), name=name, **kwargs):
                answer = rule(*args, **kwargs)
                calls.append((sys._getframe(1).f_globals["__name__"], name, args + tuple(kwargs.values()), answer))
                return answer
            monkeypatch.setattr(book, name, spy)
        return calls
    return watch


# A small run of the built-in task: 3 steps of 16 samples, a checkpoint after each, evaluation at the start
# and the end. Placements whose samples depend on the seed alone, with their world sizes.
SMALL_STEPS = 3
SMALL = ["--prompts-per-step", 4, "--group-size", 4, "--eval-every", 100,
         "--eval-prompts", 8, "--checkpoint-every", 1]
FINAL = f"checkpoints/step-{SMALL_STEPS:06d}/state.bin"
PLACEMENTS = {
    "colocated": ([], 2),
    "pivot": (["--placement", "pivot", "--trace-rounds"], 2),
    "forced": (["--placement", "pivot", "--force-shifts", 3, "--force-shift-rate", 0.3], 2),
    "disaggregated": (["--placement", "disaggregated", "--split", "rollout=1,judge=1,train=1"], 3),
    # --max-staleness: the update K steps behind the rollout (tests/e2e/test_staleness.py); K = 1 with two
    # minibatches, whose pi_old the rollout correction computes before the first optimizer step
    "colocated-k1": (["--max-staleness", 1, "--minibatches", 2, "--rollout-is", "sequence"], 2),
    "forced-k1": (["--placement", "pivot", "--force-shifts", 3, "--force-shift-rate", 0.3, "--max-staleness", 1,
                   "--minibatches", 2, "--rollout-is", "sequence"], 2),
    "pivot-k2": (["--placement", "pivot", "--max-staleness", 2, "--updates", "step", "--rollout-is", "token"], 2),
    "disaggregated-k2": (["--placement", "disaggregated", "--split", "rollout=1,judge=1,train=1",
                          "--max-staleness", 2, "--updates", "step"], 3),
    # --max-staleness with no checkpoint to stop at: each update published as soon as it is made, the
    # engines go on under it, and the next step begins (tests/e2e/test_staleness.py); their rounds, recorded,
    # are replayed through the simulator's book there
    "pivot-k1-ahead": (["--placement", "pivot", "--max-staleness", 1, "--checkpoint-every", 0, "--trace-rounds"], 2),
    "disaggregated-k2-ahead": (["--placement", "disaggregated", "--split", "rollout=1,judge=1,train=1",
                                "--max-staleness", 2, "--updates", "step", "--checkpoint-every", 0, "--trace-rounds"], 3),
    "disaggregated-k2-every2": (["--placement", "disaggregated", "--split", "rollout=1,judge=1,train=1",
                                 "--max-staleness", 2, "--updates", "step", "--checkpoint-every", 2], 3),
    # --updates ready (the default at K >= 2) on the long-tail workload, whose slowest groups a step's end
    # leaves to the next update (tests/e2e/test_ready_first.py): 8 prompts of 4 responses a step
    **{f"{name}-ready": ([*flags, "--max-staleness", 2, "--prompts-per-step", 8, "--workload", "longtail",
                          "--max-response-tokens", 48, "--max-critique-tokens", 48, "--checkpoint-every", 0,
                          "--trace-rounds"], nproc)
       for name, flags, nproc in [
           ("colocated", [], 2), ("pivot", ["--placement", "pivot"], 2),
           ("forced", ["--placement", "pivot", "--force-shifts", 3, "--force-shift-rate", 0.3], 2),
           ("disaggregated", ["--placement", "disaggregated", "--split", "rollout=1,judge=1,train=1"], 3),
           ("pivot-tp2", ["--placement", "pivot", "--engine-tp", 2], 4)]},
    "forced-ready-every2": (["--placement", "pivot", "--force-shifts", 3, "--force-shift-rate", 0.3, "--max-staleness", 2,
                             "--prompts-per-step", 8, "--workload", "longtail", "--max-response-tokens", 48,
                             "--max-critique-tokens", 48, "--checkpoint-every", 2], 2),
    # --engine-tp 2: engines of two ranks on four, colocated and with forced moves of slots, and a split of three
    # slots on six
    # (tests/e2e/test_engine_tp.py)
    "colocated-tp2": (["--engine-tp", 2], 4),
    "forced-tp2": (["--engine-tp", 2, "--placement", "pivot", "--force-shifts", 3, "--force-shift-rate", 0.3], 4),
    "disaggregated-tp2": (["--engine-tp", 2, "--placement", "disaggregated", "--split", "rollout=1,judge=1,train=1"], 6),
    # --filter-groups: 4 informative groups a step, at most 16 prompts drawn (tests/e2e/test_filter_groups_runs.py);
    # avg@3 of the held-out prompts beside the greedy accuracy (tests/e2e/test_eval_samples_runs.py)
    "pivot-filter": (["--placement", "pivot", "--filter-groups", "--eval-samples", 3], 2),
    "colocated-filter": (["--filter-groups", "--eval-samples", 3], 2),
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


def torchrun_nodes(script, *args, nodes=2, nproc=1, timeout=600, node_args=None, check=True,
                   env=None) -> list[subprocess.CompletedProcess]:
    """Runs `script` as `nodes` torchrun agents on this machine started together, each one node of
    `nproc` ranks (`--nnodes`, `--node_rank`, `--master_addr=127.0.0.1`); `node_args[n]`: arguments for
    node n alone. With `check`, fails the test with the output's tail of an agent that failed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    agents = []
    for node in range(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node_rank={node}",
               f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={port}", str(script),
               *map(str, args), *map(str, (node_args or {}).get(node, []))]
        log = tempfile.TemporaryFile("w+")  # not a pipe: an agent blocked on a full pipe would stall the other
        agents.append((cmd, log, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                  text=True)))
    done = []
    for cmd, log, agent in agents:
        try:
            agent.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for *_, other in agents:
                other.terminate()  # torchrun stops its workers on SIGTERM
                other.wait()
            raise
        log.seek(0)
        done.append(subprocess.CompletedProcess(cmd, agent.returncode, log.read(), ""))
        log.close()
    failed = [p for p in done if p.returncode != 0]
    if check and failed:
        pytest.fail(f"{' '.join(failed[0].args)} exited {failed[0].returncode}\n{failed[0].stdout[-6000:]}")
    return done


def small_run(out, placement, *, steps=SMALL_STEPS, nodes=1, **kw):
    """A small run of `placement` into `out`, on one node or on `nodes` agents sharing its ranks."""
    flags, nproc = PLACEMENTS[placement]
    args = [*SMALL, "--steps", steps, "--out", out, *flags]
    if nodes == 1:
        return torchrun(ROOT / "pivot_train.py", *args, nproc=nproc, **kw)
    return torchrun_nodes(ROOT / "pivot_train.py", *args, nodes=nodes, nproc=nproc // nodes, **kw)


def restarted(proc) -> str:
    """The line a run restarted after a kill printed on taking up the run (proof that the kill happened)."""
    lines = [line for line in proc.stdout.splitlines() if "resuming from" in line or "starting over" in line]
    assert len(lines) == 1, proc.stdout[-3000:]
    return lines[0]


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def timeline_gaps(spans: list[dict], longest: float = 0.5) -> list[tuple[int, float, float]]:
    """Each stretch of a rank's time longer than `longest` seconds, between its first span's start and
    its last span's end, that none of its spans (a role, a shift, a wait, a phase) covers: (rank, start,
    end). A run's timeline.jsonl that accounts for the whole run has none."""
    gaps = []
    for rank in sorted({s["rank"] for s in spans}):
        mine = sorted((s["start"], s["end"]) for s in spans if s["rank"] == rank)
        covered = mine[0][1]
        for start, end in mine[1:]:
            if start - covered > longest:
                gaps.append((rank, covered, start))
            covered = max(covered, end)
    return gaps


def samples(out):
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def same_run(a, b, exact: bool = True):
    """The run in `b` ended where the one in `a` did: every sample and every metric that does not measure
    time, and the training state bit for bit; not `exact` (a pivot run that trained groups early, whose
    gradients summed in another order), the state to a relative 1e-6."""
    assert [r["step"] for r in metrics(b)] == list(range(SMALL_STEPS + 1))
    assert samples(a) == samples(b)
    for key in ("reward_mean", "samples", "eval_accuracy", "judge_agreement") + (("loss", "grad_norm") if exact else ()):
        assert [r.get(key) for r in metrics(a)] == [r.get(key) for r in metrics(b)], key
    if exact:
        assert (a / FINAL).read_bytes() == (b / FINAL).read_bytes()
    else:
        # The state's buffer: a 64-byte header, then fp32 tensors (with zero padding between them).
        x, y = (np.fromfile(run / FINAL, dtype=np.float32, offset=64).astype(np.float64) for run in (a, b))
        assert np.linalg.norm(x - y) <= 1e-6 * np.linalg.norm(x)


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """`uninterrupted(placement)`: (run directory, finished process) of the small run on one node, made on
    first use and shared by every test of the session."""
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
    make_model(str(root / "judge"), init_std=0.2, seed=1)
    return root / "policy", root / "judge"


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
