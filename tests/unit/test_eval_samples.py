"""--eval-samples K: avg@K of the held-out prompts (K answers each at --temperature, each seeded) beside
the greedy accuracy. The count by hand and the seeds; the runs are in tests/e2e/test_eval_samples_runs.py."""
import pytest

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
