"""--engine-tp 2: four ranks in two slots of two, each slot one rollout or judge engine (vLLM tensor parallel)
that shifts, drains, exports and reloads as one; the train role is FSDP2 over the train slots' ranks."""
import json
import os
import subprocess
import sys
import time
from collections import Counter

from conftest import ROOT, SMALL, SMALL_STEPS, metrics, restarted, same_run, samples, small_run

from roles.engine import SHM_DIR, SHM_PREFIX


def step_samples(run, step):
    return [s for s in samples(run) if s["step"] == step]


def test_tp2_runs_judge_every_response_once_and_migrate_slots_without_a_token_lost(uninterrupted):
    """Colocated at T = 2 answers the first step (the initial weights) token for token as T = 1 does; with
    forced moves of slots, in-flight sequences migrate between slots (every rank of a slot exports the same)
    and the run ends where the colocated T = 2 run does; a disaggregated split of three slots samples the
    first step as colocated does; the engine/trainer logprob gap stays within the T = 1 runs' bound."""
    colocated, _ = uninterrupted("colocated-tp2")
    forced, _ = uninterrupted("forced-tp2")
    one, _ = uninterrupted("colocated")
    assert step_samples(colocated, 0) == step_samples(one, 0)
    split, _ = uninterrupted("disaggregated-tp2")
    for run in (colocated, forced, split):
        for step in range(SMALL_STEPS):  # 4 prompts a step, each with its 4 responses, each judged
            rows = step_samples(run, step)
            assert sorted(Counter(r["prompt"] for r in rows).values()) == [4] * 4 and all(r["critique"] for r in rows)
    assert sum(r.get("migrated_sequences", 0) for r in metrics(forced)) > 0
    same_run(colocated, forced)
    # a split in slots: rollout on ranks 0-1, judge on 2-3, train on 4-5, each slot its role throughout
    assert step_samples(split, 0) == step_samples(colocated, 0)
    assert all(not r.get("shifts") or {s["to"] for s in r["shifts"]} == {"rollout"} for r in metrics(split))
    bound = max(r["logprob_gap_max"] for r in metrics(one) if "logprob_gap_max" in r)
    assert all(r["logprob_gap_max"] <= max(bound, 1e-4) for run in (colocated, forced, split)
               for r in metrics(run) if "logprob_gap_max" in r)


def test_a_killed_tp2_run_restarts_and_ends_as_if_never_killed(uninterrupted, tmp_path):
    """Rank 1, the second rank of slot 0, killed in its 6th engine step of rollout: torchrun restarts the
    group, whose launch names its own shared-memory segments and removes the killed launch's, and the run
    ends where the uninterrupted one does."""
    out = tmp_path / "run"
    restarted(small_run(out, "colocated-tp2", restarts=1, env={"PIVOT_KILL": "1:rollout:6"}))
    same_run(uninterrupted("colocated-tp2")[0], out)
    assert not list(SHM_DIR.glob(f"{SHM_PREFIX}*"))


def test_a_second_tp2_launch_starts_beside_a_running_one(tmp_path):
    """Two launches on one host at once, each one slot of two ranks: each engine group's shared-memory
    segments are the launch's own."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    cmd = lambda out: [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",  # noqa: E731
                       str(ROOT / "pivot_train.py"), *map(str, SMALL), "--steps", "1", "--engine-tp", "2",
                       "--checkpoint-every", "0", "--out", str(out)]
    first = subprocess.Popen(cmd(tmp_path / "a"), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    deadline = time.time() + 300
    while not list(SHM_DIR.glob(f"{SHM_PREFIX}*")) and first.poll() is None and time.time() < deadline:
        time.sleep(0.5)
    assert first.poll() is None, "the first launch ended before its engines started"
    second = subprocess.run(cmd(tmp_path / "b"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    output = first.communicate(timeout=600)[0]
    assert first.returncode == 0, output[-3000:]
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    for run in ("a", "b"):
        assert [r["step"] for r in metrics(tmp_path / run) if "samples" in r] == [0]
    assert json.loads((tmp_path / "a/config.json").read_text())["engine_tp"] == 2
