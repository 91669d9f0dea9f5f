"""--eval-samples K: avg@K of the held-out prompts (K answers each at --temperature, each seeded) beside
the greedy accuracy. The count by hand is pure; the runs are small runs of the built-in task."""
import pytest

from conftest import ROOT, metrics, torchrun
from pivot_train import avg_at_k
from roles.rollout import eval_seed, sample_seed


def test_avg_at_k_against_a_hand_count():
    # answers after the last ">": 2 of 4 right, 0 of 4 (one without a marker), 4 of 4 (spaces stripped)
    answers = [("42", ["x>42", "x>41", ">42", "42"]), ("7", ["7", "x>8", "x>", "x>17"]),
               ("100", [">100", "a>1>100", "> 100 ", "x>100"])]
    assert avg_at_k(answers, ">") == pytest.approx((2 / 4 + 0 / 4 + 4 / 4) / 3)
    assert avg_at_k([("5", ["x>5"])], ">") == 1.0  # avg@1 of one prompt


def test_eval_seeds_are_the_same_at_every_evaluation_and_apart_from_the_training_seeds():
    seeds = {eval_seed(0, p, g) for p in range(20) for g in range(4)}
    assert len(seeds) == 80 and eval_seed(0, 3, 1) == eval_seed(0, 3, 1) != eval_seed(1, 3, 1)
    assert not seeds & {sample_seed(0, step, p, g) for step in range(20) for p in range(20) for g in range(4)}


@pytest.mark.slow
def test_near_greedy_samples_score_as_the_greedy_answers(tmp_path):
    """At a temperature of 1e-4 every sampled answer is the greedy one: avg@3 is the greedy accuracy."""
    out = tmp_path / "run"
    torchrun(ROOT / "pivot_train.py", "--steps", 0, "--eval-prompts", 16, "--eval-samples", 3,
             "--temperature", 1e-4, "--out", out)
    record = metrics(out)[0]
    assert record["eval_accuracy_avg@3"] == record["eval_accuracy"]


@pytest.mark.slow
def test_a_run_reports_avg_at_k_at_every_evaluation(uninterrupted):
    out, proc = uninterrupted("pivot-filter")
    evals = [r for r in metrics(out) if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3]
    for r in evals:  # 8 held-out prompts, 3 answers each
        assert 0 <= r["eval_accuracy_avg@3"] <= 1 and (r["eval_accuracy_avg@3"] * 24) == pytest.approx(
            round(r["eval_accuracy_avg@3"] * 24))
    assert sum(" | avg@3 " in line for line in proc.stdout.splitlines()) == 2
