import pytest

from roles.genrm import fill_template, parse_verdict


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
