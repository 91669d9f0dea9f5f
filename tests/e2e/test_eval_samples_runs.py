"""--eval-samples K in runs of the built-in task: avg@K of the held-out prompts beside the greedy accuracy
at every evaluation (the count by hand: tests/unit/test_eval_samples.py)."""
import pytest

from conftest import ROOT, metrics, torchrun


def test_near_greedy_samples_score_as_the_greedy_answers(tmp_path):
    """At a temperature of 1e-4 every sampled answer is the greedy one: avg@3 is the greedy accuracy."""
    out = tmp_path / "run"
    torchrun(ROOT / "pivot_train.py", "--steps", 0, "--eval-prompts", 16, "--eval-samples", 3,
             "--temperature", 1e-4, "--out", out)
    record = metrics(out)[0]
    assert record["eval_accuracy_avg@3"] == record["eval_accuracy"]


def test_a_run_reports_avg_at_k_at_every_evaluation(uninterrupted):
    out, proc = uninterrupted("pivot-filter")
    evals = [r for r in metrics(out) if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3]
    for r in evals:  # 8 held-out prompts, 3 answers each
        assert 0 <= r["eval_accuracy_avg@3"] <= 1 and (r["eval_accuracy_avg@3"] * 24) == pytest.approx(
            round(r["eval_accuracy_avg@3"] * 24))
    assert sum(" | avg@3 " in line for line in proc.stdout.splitlines()) == 2
