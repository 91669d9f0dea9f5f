"""The algorithm a run trains with, in one place: where a sample's reward comes from, how a group's rewards
become advantages, and the terms of the loss. `Algorithm` holds it, frozen, one field per flag; it makes
those flags (`add_flags`, the "algorithm" group of --help), is built from them once (`from_args`), names
the flags a resumed run must keep (`FLAGS`), and is handed to the judge (its `recipe`), to the scheduler
(early training) and to the trainer (the loss). `group_advantages` is the one place rewards become
advantages: early training and the update both call it, so an edit there changes both alike.

Where an edit of the algorithm goes, with worked examples: docs/algorithm.md.

Reward sources (`--reward judge=1,exact=1,overlong=1`, each with a coefficient, summed):

- judge: the judge's verdict or rubric score (roles/judge.py), in [0, 1]; the default, alone;
- the rule sources of `RULES`: exact (1 if the answer after the last --answer-marker equals the record's
  reference, else 0), format (1 if the response ends with an answer after --answer-marker, else 0) and
  overlong (DAPO's soft overlong punishment, Yu et al. 2025, arXiv:2503.14476, eq. 13: 0 up to
  --max-response-tokens minus --overlong-buffer tokens, then down linearly to -1 at --max-response-tokens).

Every source's score stays on the sample (`Sample.scores`); the one place a verdict becomes a reward
(`roles/judge.py` `Verdict.apply`) calls `Recipe`.
"""
import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from roles import Role

# How a minibatch's token losses become its loss: verl's loss_agg_mode (agg_loss in
# verl/trainer/ppo/core_algos.py). token-mean: the mean over all response tokens; seq-mean-token-mean:
# each response's token mean, then the mean over responses (textbook GRPO); seq-mean-token-sum: each
# response's token sum, then the mean over responses (Dr. GRPO's unnormalised length, arXiv:2503.20783).
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
ROLLOUT_IS = ("off", "token", "sequence")
ADVANTAGE_EPS = 1e-6  # added to a group's std before dividing by it


# -- rewards ----------------------------------------------------------------------------------------

def final_answer(response: str, marker: str) -> str | None:
    """The text after the last `marker`, stripped; None when the response has none."""
    return response.rsplit(marker, 1)[1].strip() if marker in response else None


def matches_reference(response: str, reference: str | None, marker: str) -> bool:
    """Whether the answer after the last `marker` is the reference: the one check of an answer, for the
    exact source, the judge's agreement and the held-out accuracy."""
    return final_answer(response, marker) == (reference or "").strip()


def exact_score(response: str, reference: str, marker: str) -> float:
    return 1.0 if matches_reference(response, reference, marker) else 0.0


def format_score(response: str, marker: str) -> float:
    """1 if the response ends with its answer: text after its last `marker`, on the marker's line, with
    nothing after that line (DeepSeek-R1's format reward asks the same of its tags, arXiv:2501.12948)."""
    answer = final_answer(response, marker)
    return 1.0 if answer and "\n" not in answer else 0.0


def overlong_score(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment of a response of `length` tokens."""
    free = max_tokens - buffer
    if length <= free:
        return 0.0
    if length <= max_tokens:
        return (free - length) / buffer
    return -1.0


@dataclass(frozen=True)
class Rule:
    """A rule source of the reward: what --help says of it, its score of one response (the response, its
    token count, the record's reference, the recipe), and whether every record needs a reference."""
    says: str
    score: Callable[[str, int, str | None, "Recipe"], float]
    needs_reference: bool = False


RULES = {
    "exact": Rule("1 if the answer after --answer-marker equals the reference, else 0",
                  lambda response, tokens, reference, recipe: exact_score(response, reference, recipe.answer_marker),
                  needs_reference=True),
    "format": Rule("1 if the response ends with an answer after --answer-marker, else 0",
                   lambda response, tokens, reference, recipe: format_score(response, recipe.answer_marker)),
    "overlong": Rule("DAPO's penalty, 0 down to -1 over the last --overlong-buffer tokens",
                     lambda response, tokens, reference, recipe: overlong_score(
                         tokens, recipe.max_response_tokens, recipe.overlong_buffer)),
}
SOURCES = (Role.JUDGE, *RULES)
NEEDS_REFERENCE = tuple(name for name, rule in RULES.items() if rule.needs_reference)


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
        return {Role.JUDGE: judge, **{name: RULES[name].score(response, response_tokens, reference, self)
                                      for name, _ in self.coefficients if name != Role.JUDGE}}

    def reward(self, scores: dict[str, float]) -> float:
        return sum(coefficient * scores[name] for name, coefficient in self.coefficients)


# -- advantages -------------------------------------------------------------------------------------

def grpo_advantages(rewards: torch.Tensor, scale_by_std: bool = True, eps: float = ADVANTAGE_EPS) -> torch.Tensor:
    """rewards: [groups, G] -> advantages of the same shape: each reward less its group's mean, divided by
    the group's unbiased std (+ eps) where `scale_by_std`. Each row depends on that row alone."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def informative(rewards: list[float]) -> bool:
    """Whether a group's rewards differ. A group of equal rewards has zero advantages, so it adds nothing
    to the gradient but its tokens to the loss's denominator; DAPO's dynamic sampling (Yu et al. 2025,
    arXiv:2503.14476, section 3.2) leaves such groups out of the update (--filter-groups)."""
    return max(rewards) != min(rewards)


# -- the algorithm and its flags --------------------------------------------------------------------

def flag(default, help: str, *, holds: Callable | None = None, rule: str = "", choices: tuple | None = None):
    """A field of `Algorithm` and its flag: the default, the help line, and for a number what a usable
    value satisfies (`holds`) with the error's wording of it (`rule`)."""
    return field(default=default, metadata=dict(help=help, holds=holds, rule=rule, choices=choices))


@dataclass(frozen=True)
class Algorithm:
    """GRPO as this run trains it (Shao et al. 2024, arXiv:2402.03300, with the departures the script's
    docstring lists). One field per flag of the "algorithm" group; a new option is a field here and its
    use in a method below or in the loss (roles/trainer.py)."""
    # reward
    reward: str = flag("judge=1", "the reward's sources with a coefficient each, summed: judge (the judge's "
                       "score), " + ", ".join(f"{name} ({rule.says})" for name, rule in RULES.items())
                       + "; e.g. judge=1,exact=1,overlong=1")
    overlong_buffer: int = flag(0, "with overlong in --reward: the tokens before --max-response-tokens over which "
                                "the penalty falls from 0 to -1 (DAPO uses a fifth of the budget)",
                                holds=lambda v: v >= 0, rule="0 or more (tokens before --max-response-tokens "
                                                             "where the overlong penalty falls to -1)")
    # advantages
    norm_adv_by_std: bool = flag(True, "divide each group's centred rewards by the group's std (GRPO); "
                                 "--no-norm-adv-by-std leaves them centred only (Dr. GRPO, arXiv:2503.20783; verl's "
                                 "norm_adv_by_std_in_grpo, TRL's scale_rewards='none')")
    # loss
    clip_eps: float = flag(0.2, "the ratio's clip: [1 - eps, 1 + eps]", holds=lambda v: 0 < v < 1,
                           rule="in (0, 1): PPO keeps the ratio within [1 - eps, 1 + eps], e.g. 0.2")
    clip_eps_high: float | None = flag(None, "the ratio's upper clip is 1 + this (DAPO's clip-higher, e.g. 0.28); "
                                       "default: --clip-eps", holds=lambda v: v > 0,
                                       rule="above 0: the ratio's upper clip is 1 + it (DAPO's clip-higher uses "
                                            "0.28; unset: --clip-eps)")
    clip_ratio_c: float = flag(3.0, "dual clip: with a negative advantage A the token loss is at most -C*A (verl's "
                               "clip_ratio_c); 0 turns it off", holds=lambda v: v == 0 or v > 1,
                               rule="0 (no dual clip) or above 1: the dual clip's bound on a negative advantage's "
                                    "ratio (verl uses 3)")
    loss_agg: str = flag("token-mean", "how a minibatch's token losses are averaged (verl's loss_agg_mode): over "
                         "all its response tokens, each response's mean then over responses, or each response's "
                         "sum then over responses", choices=LOSS_AGGS)
    kl_coef: float = flag(0.0, "k3 KL to the initial policy; 0 skips it (and keeps no reference copy)",
                          holds=lambda v: v >= 0, rule="0 or more (0: no KL penalty to the initial policy)")
    rollout_is: str = flag("off", "rollout correction: the ratio against pi_old (recomputed) and each token's loss "
                           "weighted by the truncated ratio pi_old / pi_rollout, per token or per sequence; off: "
                           "the ratio against the sampling logprobs, whose clip then bounds how far an update "
                           "moves from them", choices=ROLLOUT_IS)
    rollout_is_threshold: float = flag(2.0, "the rollout correction's truncation: no weight above it",
                                       holds=lambda v: v > 1,
                                       rule="above 1: the largest importance weight kept (verl uses 2.0)")

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """[groups, G] rewards -> advantages of the same shape, a row per group."""
        return grpo_advantages(rewards, scale_by_std=self.norm_adv_by_std)

    @property
    def keeps_reference(self) -> bool:
        """Whether the trainer keeps a frozen copy of the initial policy (for the KL term)."""
        return self.kl_coef > 0

    def recipe(self, answer_marker: str, max_response_tokens: int) -> Recipe:
        """The reward's recipe (ValueError says what to change in --reward)."""
        return Recipe(parse_reward(self.reward), answer_marker, max_response_tokens, self.overlong_buffer)


def group_advantages(algorithm: Algorithm, groups: list[list]) -> None:
    """Each sample of each group (its G samples, each with `.reward`) gets its `.advantage`: the one place
    the run turns rewards into advantages, for early training (shifting/scheduler.py) and the update
    (pivot_train.py) alike."""
    if not groups:
        return
    rewards = torch.tensor([[s.reward for s in group] for group in groups])
    for group, row in zip(groups, algorithm.advantages(rewards).tolist()):
        for s, a in zip(group, row):
            s.advantage = a


FLAGS = tuple(f.name for f in dataclasses.fields(Algorithm))  # a resumed run keeps every one


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The "algorithm" group of flags, one per field of `Algorithm`, with its default and help."""
    group = parser.add_argument_group("algorithm", "the reward, the advantages and the loss (algorithm.py)")
    for f in dataclasses.fields(Algorithm):
        meta, name = f.metadata, "--" + f.name.replace("_", "-")
        if f.type is bool:
            group.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default, help=meta["help"])
        else:  # int, float, str, or one of them | None
            kind = next(k for k in (int, float, str) if f.type is k or k in getattr(f.type, "__args__", ()))
            group.add_argument(name, type=kind, default=f.default, choices=meta["choices"], help=meta["help"])


def number_rules() -> list[tuple[str, Callable, str]]:
    """(flag, what a usable value satisfies, the rule as the error says it) for each numeric flag."""
    return [(f.name, f.metadata["holds"], f.metadata["rule"]) for f in dataclasses.fields(Algorithm)
            if f.metadata["holds"]]


def from_args(args) -> Algorithm:
    """The run's algorithm from its parsed flags (checked by pivot_train.check_config)."""
    return Algorithm(**{name: getattr(args, name) for name in FLAGS})
