"""Sequence migration under seeded random shift schedules (--force-shifts), two ranks, real engines."""
import json

from conftest import JUDGE, POLICY, ROOT, torchrun

TRIALS = 12


def test_forced_shifts_lose_and_repeat_nothing(tmp_path):
    torchrun(ROOT / "tests/workers/scheduler_invariants.py", POLICY, JUDGE, ROOT / "tasks/judge_arith.txt",
             TRIALS, tmp_path, timeout=900)
    r = json.loads((tmp_path / "rank0.json").read_text())
    expected = [[p, g] for p in range(5) for g in range(3)]
    assert r["reference_judge_runs"] == len(expected)
    assert len(r["trials"]) == TRIALS
    for trial in r["trials"]:
        assert trial["keys"] == expected          # every prompt, exactly G responses
        assert trial["judge_runs"] == len(expected)  # each judged exactly once
        assert trial["same_responses"]            # no token lost or repeated, moves or not
        assert trial["logprob_gap"] < 1e-4
        assert trial["same_critiques"]
        if trial["shifts"]:
            assert {"drain", "offload", "onload", "ready", "seconds", "from", "to", "rank"} <= set(trial["stages"])
    assert sum(t["migrated"] for t in r["trials"]) > 0
    assert sum(t["migrated"] > 0 for t in r["trials"]) >= TRIALS // 2
    # the same update with and without migrations
    assert r["weight_gap"] < 1e-6
