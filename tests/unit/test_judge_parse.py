import pytest

from roles.judge import fill_template, parse_rubric_score, parse_verdict


@pytest.mark.parametrize("critique, reward", [
    ("7+5=12>12; got 12; verdict: correct", 1.0),
    ("7+5=12>12; got 13; verdict: wrong", 0.0),
    ("verdict:correct", 1.0),
    ("verdict: wrong ... verdict: correct", 1.0),   # the last verdict stands
    ("verdict: correct, no wait, verdict: wrong", 0.0),
])
def test_verdicts(critique, reward):
    assert parse_verdict(critique) == reward


@pytest.mark.parametrize("critique", ["", "7+5=12; got 12", "verdict: maybe", "verdict: correctly", "verdict"])
def test_unreadable_outputs_are_failures(critique):
    assert parse_verdict(critique) is None


def test_template_keeps_braces_in_the_response():
    text = fill_template("q: {prompt}\na: {response}\nref: {reference}\n", "1+1=", "{x}>2", None)
    assert text == "q: 1+1=\na: {x}>2\nref: \n"


def test_template_shows_the_rubric():
    text = fill_template("{prompt}|{rubric}|{response}", "2+2=", "4", "4", rubric="states the sum")
    assert text == "2+2=|states the sum|4"


@pytest.mark.parametrize("critique, score", [
    ("meets the rubric fully. score: 10", 10),
    ("score: 1", 1),
    ("Score: 7", 7),                          # any case
    ("SCORE:4/10", 4),                        # out of ten
    ("the answer is right.\nscore: 8.", 8),   # a full stop after it
    ("score: 8\n", 8),
    ("score: 2 ... on reflection, score: 9", 9),  # the last score stands
])
def test_rubric_scores_map_to_rewards(critique, score):
    assert parse_rubric_score(critique) == pytest.approx((score - 1) / 9)


MALFORMED = [
    "",                                    # nothing
    "the response is fine",                # no score line
    "score:",                              # no number
    "score: ten",                          # not a number
    "score: 0",                            # below the scale
    "score: 11",                           # above it
    "score: 7.5",                          # not an integer
    "score: 7,5",
    "score: -3",
    "score: 7/5",                          # out of something other than ten
    "score: 9 ... final score: maybe",     # the last score is unreadable: no guessing from an earlier one
    "scores: 5",                           # not the word score
    "underscore: 5",
]


# Each is a parse failure, counted in the step's judge_parse_failures (tests/e2e/test_architectures.py checks
# the count in a run whose random judge writes nothing readable).
@pytest.mark.parametrize("critique", MALFORMED)
def test_malformed_rubric_outputs_are_failures(critique):
    assert parse_rubric_score(critique) is None
