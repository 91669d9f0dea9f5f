"""Small whole runs of the built-in task (tests/conftest.py's `uninterrupted`, shared with
tests/e2e/test_resume.py): a planner-driven pivot run against a colocated one, and what a run prints."""
import json
import re

from conftest import BENCH_JSON, ROOT, SMALL, SMALL_STEPS, same_run, torchrun
from sim.replay import replay_run


def rows(out, name):
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def test_pivot_run_without_kills_is_the_colocated_run(uninterrupted):
    """The planner moves ranks as it measures, never what a sample is or what the update does: every
    sample generated and judged once, the same samples and rewards as colocated's, step for step, and
    the same final training state (to float rounding: groups trained early sum their gradients in
    another order). Its rounds replay through the simulator's book with no difference, among them the
    prefill budget of its judge engines in timed rounds (book.prefill_budget), from the speed its planner
    measured."""
    (colocated, _), (pivot, _) = uninterrupted("colocated"), uninterrupted("pivot")
    steps = [r for r in rows(pivot, "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in steps] == list(range(SMALL_STEPS))
    for r in steps:
        assert r["samples"] == 16 and r["judge_requests"] == 16  # each sample judged once, nothing re-judged
    same_run(colocated, pivot, exact=False)
    assert replay_run(pivot, json.loads(BENCH_JSON.read_text())) == []
    rounds = [rec for line in rows(pivot, "rounds.jsonl") for rec in line["rounds"] if "budget" in rec]
    assert any(rec["budget"]["judge"] for rec in rounds) and not any(rec["budget"]["rollout"] for rec in rounds)
    # what the planner did, for whoever reads the log
    print("pivot shifts per step:", [len(r["shifts"]) for r in steps],
          "migrated:", [r["migrated_sequences"] for r in steps])


def test_console_is_one_line_per_step_and_evaluation_then_a_summary(uninterrupted):
    out, proc = uninterrupted("pivot")
    lines = (proc.stdout + proc.stderr).splitlines()
    # the real warning (tests/conftest.py's CONSOLE_ENV): each rank's two engines report it as they start
    real = [line for line in lines if re.search(r"WARNING .* Unknown vLLM environment variable detected: "
                                                r"VLLM_NOT_A_SETTING$", line)]
    assert len(real) == 4
    expected = [r"data: 5000 training prompts, 8 held-out; .*",
                r"eval at step 0 \| accuracy \d\.\d{3} \| judge agreement \d\.\d{3} \| 8 held-out prompts",
                *[rf"step {k}/3 \| reward \d\.\d{{3}} \| [\d.]+ samples/s \| [\d.]+ s \| busy s: rollout [\d.]+ "
                  rf"judge [\d.]+ train [\d.]+ \| elapsed [\dhms]+ eta [\dhms]+" for k in range(SMALL_STEPS)],
                r"eval at step 3 \| accuracy \d\.\d{3} \| judge agreement \d\.\d{3} \| 8 held-out prompts",
                r"done: 3 steps, 48 samples in \d+ s of steps \([\d.]+ samples/s\); eval accuracy \d\.\d{3} at "
                r"step 0 -> \d\.\d{3} at step 3, judge agreement \d\.\d{3}",
                rf"files in {re.escape(str(out))}: checkpoints/ config.json curves.png events.out.tfevents.\S+ "
                r"metrics.jsonl model/ rounds.jsonl run_info.json samples.jsonl timeline.jsonl timeline.png "
                r"timeline_step.png"]  # rounds.jsonl: the run keeps its rounds (--trace-rounds)
    rest = [line for line in lines if line not in real]
    assert len(rest) == len(expected), "\n".join(rest)
    for line, pattern in zip(rest, expected):
        assert re.fullmatch(pattern, line), (line, pattern)


def test_a_run_from_the_exported_model_starts_where_the_first_ended(uninterrupted, tmp_path):
    """OUT/model is the final policy: the last checkpoint's model/ holds the same weights, and a run
    from --policy OUT/model with the same seed evaluates to the first run's final eval accuracy."""
    out, _ = uninterrupted("colocated")
    final = out / f"checkpoints/step-{SMALL_STEPS:06d}/model/model.safetensors"
    assert (out / "model/model.safetensors").read_bytes() == final.read_bytes()
    again = tmp_path / "again"
    torchrun(ROOT / "pivot_train.py", *SMALL, "--steps", 0, "--policy", out / "model", "--out", again)
    first, second = rows(out, "metrics.jsonl")[-1], rows(again, "metrics.jsonl")[0]
    assert second["step"] == 0 and first["step"] == SMALL_STEPS
    for key in ("eval_accuracy", "judge_agreement", "judge_confusion"):
        assert second[key] == first[key], key
