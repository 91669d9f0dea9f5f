"""The reward's sources (algorithm.py) against hand computations, and the one place they become a sample's
reward (roles/judge.py's Verdict.apply). Pure: milliseconds."""
import pytest

from algorithm import Recipe, exact_score, final_answer, format_score, overlong_score, parse_reward
from roles.judge import Verdict
from roles.rollout import Sample


def test_parse_reward():
    assert parse_reward("judge=1") == (("judge", 1.0),)
    assert parse_reward("judge=1,exact=0.5,overlong=2") == (("judge", 1.0), ("exact", 0.5), ("overlong", 2.0))
    for text, message in (("critic=1", "'critic' is not a reward source"), ("exact", "exact needs a number"),
                          ("judge=1,judge=2", "judge appears twice"), ("exact=inf", "must be a finite number")):
        with pytest.raises(ValueError, match=message):
            parse_reward(text)


def test_exact_answer_after_the_last_marker():
    assert final_answer("12+3 > 15 > 16 ", ">") == "16"
    assert exact_score("so > 42", " 42 ", ">") == 1.0
    assert exact_score("so > 41", "42", ">") == 0.0
    assert exact_score("42", "42", ">") == 0.0  # no marker, no answer


def test_format_asks_for_an_answer_that_ends_the_response():
    assert format_score("3+4=7>7", ">") == 1.0
    assert format_score("3+4=7> 7 ", ">") == 1.0
    assert format_score("3+4=7", ">") == 0.0  # no marker
    assert format_score("3+4=7>", ">") == 0.0  # a marker with no answer
    assert format_score("3+4=7>7\nand more", ">") == 0.0  # text after the answer's line
    sample = Sample(0, 0, [1], [5], [0.0], "stop", response="1+1>3", reference="2")
    verdict(0.0, Recipe((("judge", 1.0), ("format", 0.5)), ">", 8, 0)).apply(sample)
    assert sample.scores == {"judge": 0.0, "format": 1.0} and sample.reward == 0.5


def test_overlong_penalty_by_hand():
    """DAPO's soft overlong punishment with a budget of 64 tokens and a buffer of 16: free up to 48, then
    -(L - 48) / 16, -1 at 64."""
    assert [overlong_score(n, 64, 16) for n in (10, 48, 52, 56, 64, 70)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]


def verdict(reward: float, recipe: Recipe) -> Verdict:
    return Verdict((0, 0), "critique", 3, 5, reward, False, True, 0, recipe=recipe)


def test_the_verdict_becomes_the_reward_with_the_rules():
    recipe = Recipe((("judge", 1.0), ("exact", 0.5), ("overlong", 2.0)), ">", 8, 4)
    sample = Sample(0, 0, [1], [5] * 7, [0.0] * 7, "length", response="1+1>2", reference="2")
    verdict(1.0, recipe).apply(sample)
    # judge 1, exact 1, overlong -(7 - 4) / 4: 1 * 1 + 0.5 * 1 + 2 * -0.75
    assert sample.scores == {"judge": 1.0, "exact": 1.0, "overlong": -0.75}
    assert sample.reward == pytest.approx(0.0)
    # without the judge in the recipe, its score is still kept (its agreement is measured), not rewarded
    verdict(1.0, Recipe((("exact", 1.0),), ">", 8, 4)).apply(sample)
    assert sample.scores == {"judge": 1.0, "exact": 1.0} and sample.reward == 1.0


def test_the_default_reward_is_the_verdict_itself():
    for judged in (0.0, 1.0, 5 / 9):
        sample = Sample(0, 0, [1], [5], [0.0], "stop", response="x")
        verdict(judged, Recipe()).apply(sample)
        assert sample.reward == judged and sample.scores == {"judge": judged}
