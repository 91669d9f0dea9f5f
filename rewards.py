"""A sample's reward from several sources, each with a coefficient (`--reward judge=1,exact=1,overlong=1`):

- judge: the judge's verdict or rubric score (roles/judge.py), in [0, 1]; the default, alone;
- exact: 1 if the answer after the last --answer-marker equals the record's reference, else 0;
- overlong: DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13): 0 up to
  --max-response-tokens minus --overlong-buffer tokens, then down linearly to -1 at --max-response-tokens.

The reward is the sum of each source's score times its coefficient; every source's score stays on the
sample (`Sample.scores`). Pure: the one place a verdict becomes a reward (`Verdict.apply`) calls it.
"""
from dataclasses import dataclass

from roles import Role

SOURCES = (Role.JUDGE, "exact", "overlong")
NEEDS_REFERENCE = ("exact",)


def parse_reward(text: str) -> tuple[tuple[str, float], ...]:
    """`judge=1,exact=0.5` -> (("judge", 1.0), ("exact", 0.5)); ValueError says what to change."""
    pairs = []
    for part in text.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in SOURCES:
            raise ValueError(f"--reward {text}: {name!r} is not a reward source; use {', '.join(SOURCES)}")
        try:
            coefficient = float(value)
        except ValueError:
            raise ValueError(f"--reward {text}: {name} needs a number, as in {name}=1") from None
        if coefficient != coefficient or coefficient in (float("inf"), float("-inf")):
            raise ValueError(f"--reward {text}: {name}'s coefficient must be a finite number")
        if name in dict(pairs):
            raise ValueError(f"--reward {text}: {name} appears twice")
        pairs.append((name, coefficient))
    return tuple(pairs)


def final_answer(response: str, marker: str) -> str | None:
    """The text after the last `marker`, stripped; None when the response has none."""
    return response.rsplit(marker, 1)[1].strip() if marker in response else None


def matches_reference(response: str, reference: str | None, marker: str) -> bool:
    """Whether the answer after the last `marker` is the reference: the one check of an answer, for the
    exact source, the judge's agreement and the held-out accuracy."""
    return final_answer(response, marker) == (reference or "").strip()


def exact_score(response: str, reference: str, marker: str) -> float:
    return 1.0 if matches_reference(response, reference, marker) else 0.0


def overlong_score(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment of a response of `length` tokens."""
    free = max_tokens - buffer
    if length <= free:
        return 0.0
    if length <= max_tokens:
        return (free - length) / buffer
    return -1.0


@dataclass(frozen=True)
class Recipe:
    """The sources of the reward and what their rules need (`--reward`, `--answer-marker`,
    `--max-response-tokens`, `--overlong-buffer`)."""
    coefficients: tuple[tuple[str, float], ...] = ((Role.JUDGE, 1.0),)
    answer_marker: str = ">"
    max_response_tokens: int = 0
    overlong_buffer: int = 0

    def scores(self, response: str, response_tokens: int, reference: str | None, judge: float) -> dict[str, float]:
        """Each source's score of one response: the judge's always (it judges every response, and its
        agreement with the reference is measured), and each rule's in the recipe."""
        rules = {"exact": lambda: exact_score(response, reference, self.answer_marker),
                 "overlong": lambda: overlong_score(response_tokens, self.max_response_tokens, self.overlong_buffer)}
        return {Role.JUDGE: judge, **{name: rules[name]() for name, _ in self.coefficients if name != Role.JUDGE}}

    def reward(self, scores: dict[str, float]) -> float:
        return sum(coefficient * scores[name] for name, coefficient in self.coefficients)
