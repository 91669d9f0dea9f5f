"""A run survives a crash. With a checkpoint every step, one rank killed with SIGKILL (faults.py) at a
random moment (rolling out, judging, training, in a shift, while a checkpoint is written), torchrun
restarts the group and the run ends exactly where the uninterrupted run ends: training state bit for
bit, and the same metrics. So does a run stopped and started again with the same command. The moment is
drawn afresh each session and shown in the test's id."""
import json
import random
import subprocess
import sys

import pytest

from conftest import ROOT, SMALL, STEPS, metrics, run, same_run, torchrun

_pick = random.Random()
# (placement, rank, point, how many times that rank surely passes the point in the run)
KILLS = [("colocated", 0, "rollout", 15), ("colocated", 1, "genrm", 30), ("colocated", 1, "train", STEPS),
         ("colocated", 0, "checkpoint", STEPS), ("forced", 1, "shift", 8), ("disaggregated", 2, "train", STEPS)]
KILL_PARAMS = [pytest.param(placement, spec, id=f"{placement}-{spec}")
               for placement, rank, point, passes in KILLS
               for spec in [f"{rank}:{point}:{_pick.randint(1, passes)}"]]


def restarted(proc) -> str:
    """The line the restarted run printed on taking up the run (proof that the kill happened)."""
    lines = [line for line in proc.stdout.splitlines() if "resuming from" in line or "starting over" in line]
    assert len(lines) == 1, proc.stdout[-3000:]
    return lines[0]


def test_stop_and_run_again(whole, tmp_path):
    cut = tmp_path / "cut"
    run(cut, "colocated", steps=1)
    run(cut, "colocated")
    assert (cut / "checkpoints/LATEST").read_text() == f"step-{STEPS:06d}"
    same_run(whole("colocated"), cut)


@pytest.mark.parametrize("placement, kill", KILL_PARAMS)
def test_killed_rank_is_restarted_and_the_run_ends_as_if_never_killed(whole, tmp_path, placement, kill):
    out = tmp_path / "run"
    line = restarted(run(out, placement, restarts=1, env={"PIVOT_KILL": kill}))
    rank, point, nth = kill.split(":")
    if point == "checkpoint":  # the checkpoint cut short is never the one resumed from
        assert "starting over" in line if nth == "1" else f"step-{int(nth) - 1:06d}" in line, line
    same_run(whole(placement), out)


def test_planner_driven_pivot_loses_no_step_and_no_sample(whole, tmp_path):
    out = tmp_path / "pivot"
    proc = torchrun(ROOT / "pivot_train.py", "--steps", STEPS, "--out", out, *SMALL, "--placement", "pivot",
                    restarts=1, env={"PIVOT_KILL": f"0:rollout:{_pick.randint(1, 5)}"})
    restarted(proc)
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    assert all(r["samples"] == 16 for r in rows[:-1])
    logged = [json.loads(line)["step"] for line in (out / "samples.jsonl").read_text().splitlines()]
    assert logged == sorted(logged) and all(logged.count(step) == 16 for step in range(STEPS))
    assert json.loads((out / "checkpoints/step-000003/meta.json").read_text())["planner"]["fits"]
    # Its moves follow measured speeds; its samples and update do not, so its curve is the colocated one's.
    for a, b in zip(metrics(whole("colocated")), rows):
        assert a.get("reward_mean") == pytest.approx(b.get("reward_mean"), abs=0.15)


def test_resume_with_other_settings_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    proc = subprocess.run([sys.executable, str(ROOT / "pivot_train.py"), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "no checkpoint to resume from" in proc.stderr
