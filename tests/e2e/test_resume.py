"""A run survives a crash. With a checkpoint every step, one rank killed with SIGKILL (faults.py) at some
moment (rolling out, judging, training, in a shift, while a checkpoint is written), torchrun restarts the
group and the run ends exactly where the uninterrupted run ends: training state bit for bit, and the same
samples and metrics. So does a run stopped and started again with the same command.

The moments are drawn from PIVOT_KILL_SEED (default 0; any other value tries other moments) and shown
in each test's id, e.g. `colocated-0:rollout:7`: rank 0 dies the 7th time it passes `rollout`."""
import json
import os
import random
import subprocess
import sys

import pytest

from conftest import ROOT, SMALL_STEPS, restarted, same_run, small_run

DATA = ROOT / "tests/data"

_pick = random.Random(int(os.environ.get("PIVOT_KILL_SEED", "0")))
# (placement, rank, point, how many times that rank surely passes the point in the run); the planner
# moves pivot ranks as it measures, so a pivot rank surely rolls out only in the first few engine steps.
KILLS = [("colocated", 0, "rollout", 15), ("colocated", 1, "judge", 30), ("colocated", 1, "train", SMALL_STEPS),
         ("colocated", 0, "checkpoint", SMALL_STEPS), ("forced", 1, "shift", 8),
         ("disaggregated", 2, "train", SMALL_STEPS), ("pivot", 0, "rollout", 5)]
KILL_PARAMS = [pytest.param(placement, spec, id=f"{placement}-{spec}")
               for placement, rank, point, passes in KILLS
               for spec in [f"{rank}:{point}:{_pick.randint(1, passes)}"]]


def test_stop_and_run_again(uninterrupted, tmp_path):
    """Stopped, then started again by code that has flags the first launch's did not: its config.json
    keeps only the flags of main at 7e17efd (tests/data/config_7e17efd.json, written by that code's
    default run), and the run goes on at the new flags' defaults."""
    cut = tmp_path / "cut"
    small_run(cut, "colocated", steps=1)
    older = json.loads((DATA / "config_7e17efd.json").read_text())
    config = json.loads((cut / "config.json").read_text())
    assert set(config) > set(older)
    (cut / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k in older}))
    small_run(cut, "colocated")
    assert (cut / "checkpoints/LATEST").read_text() == f"step-{SMALL_STEPS:06d}"
    same_run(uninterrupted("colocated")[0], cut)
    # the picture of the run covers both launches
    assert (cut / "curves.png").stat().st_size > 0


@pytest.mark.parametrize("placement, kill", KILL_PARAMS)
def test_killed_rank_is_restarted_and_the_run_ends_as_if_never_killed(uninterrupted, tmp_path, placement, kill):
    out = tmp_path / "run"
    line = restarted(small_run(out, placement, restarts=1, env={"PIVOT_KILL": kill}))
    rank, point, nth = kill.split(":")
    if point == "checkpoint":  # the checkpoint cut short is never the one resumed from
        assert "starting over" in line if nth == "1" else f"step-{int(nth) - 1:06d}" in line, line
    # A planner-driven pivot run's moves follow measured speeds, so after the restart they may differ;
    # its samples and update do not, so it too ends where the colocated run ends (to float rounding where
    # it trained groups early).
    same_run(uninterrupted("colocated" if placement == "pivot" else placement)[0], out, exact=placement != "pivot")
    if placement == "pivot":
        assert json.loads((out / f"checkpoints/step-{SMALL_STEPS:06d}/meta.json").read_text())["planner"]["fits"]


def test_resume_with_other_settings_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    proc = subprocess.run([sys.executable, str(ROOT / "pivot_train.py"), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "no checkpoint to resume from" in proc.stderr
