"""The algorithm in one place (algorithm.py): early training and the update give a group the same
advantages whatever the algorithm's options, its flags come from its fields, and a resumed run compares
them with the run it continues, a flag the older run lacked counting as its default."""
import copy
import dataclasses
import random

import pytest
import torch

import algorithm
import checkpoint
import pivot_train
from algorithm import Algorithm
from roles.engine import Request
from roles.judge import Verdict
from roles.rollout import Sample
from shifting.book import IN_FLIGHT
from shifting.scheduler import Report, SamplingOptions, StepQueues

G = 4
SAMPLING = SamplingOptions(group_size=G, seed=0, temperature=1.0, max_response_tokens=8, workload="task")
PROMPTS = [{"prompt": f"{p}+1=", "prompt_ids": [3, 4 + p], "reference": None, "rubric": None} for p in range(6)]


def variants() -> list[Algorithm]:
    """The default algorithm and, for each option with a fixed set of values (a switch or choices), the
    default with that option at each other value: every estimator the flags can ask for, one at a time."""
    found = [Algorithm()]
    for f in dataclasses.fields(Algorithm):
        values = f.metadata["choices"] or ((True, False) if f.type is bool else ())
        found += [dataclasses.replace(Algorithm(), **{f.name: v}) for v in values if v != f.default]
    return found


def early_trained(algo: Algorithm, rewards: list[list[float]], order: random.Random) -> list[Sample]:
    """A step's samples as early training hands them to the train ranks: rank 0's StepQueues driven by
    hand, its requests finished in a random order, each judged with the reward given."""
    queues = StepQueues(PROMPTS, step=0, sampling=SAMPLING, algo=algo, early_train=True)
    while not queues.done():
        pool = [(role, i) for role in ("rollout", "judge") for i in queues.book.queue[role]]
        role, i = pool[order.randrange(len(pool))]
        queues.book.queue[role].remove(i)
        queues.book.phase[i] = IN_FLIGHT[role]
        request, report = queues.requests[i], Report(role)
        p, g = request.key
        if role == "rollout":
            sample = Sample(p, g, request.prompt_ids, [5], [-1.0], "stop", prompt=PROMPTS[p]["prompt"], step=request.step)
            report.responses.append((sample, Request("judge", request.key, [6], 8, 0.0, step=request.step)))
        else:
            report.verdicts.append(Verdict(request.key, "", 1, 1, rewards[p][g], False, True, 0, step=request.step))
        queues.ingest([report], round_s=0.0)
    return queues.ordered_samples()


def departure(algo: Algorithm) -> str:
    return ",".join(f"{f.name}={getattr(algo, f.name)}" for f in dataclasses.fields(Algorithm)
                    if getattr(algo, f.name) != f.default) or "default"


@pytest.mark.parametrize("algo", variants(), ids=departure)
@pytest.mark.parametrize("seed", range(3))
def test_early_training_and_the_update_give_the_same_advantages(algo, seed):
    """Each group's advantages as the scheduler gives them when its last verdict comes in (what early
    training trains) equal those the update gives the same samples (pivot_train.update_samples), to the
    last digit, for every estimator: an edit of one site and not the other fails here."""
    draw = random.Random(seed)
    rewards = [[draw.choice([0.0, 0.5, 1.0]) for _ in range(G)] for _ in PROMPTS]
    rewards[0] = [1.0] * G  # a group of equal rewards
    samples = early_trained(algo, rewards, random.Random(seed))
    early = [s.advantage for s in samples]
    again = [dataclasses.replace(copy.copy(s), advantage=float("nan")) for s in samples]
    update = [s.advantage for s in pivot_train.update_samples(again, algo, G)]
    assert early == update
    assert len(set(early)) > 1  # the groups' rewards differ: advantages that are all 0 would prove nothing


def test_the_flags_are_the_fields():
    """Every field of Algorithm is a flag of the "algorithm" group, its default the field's, and the
    parsed defaults make the default algorithm; a resumed run must keep each."""
    parser = pivot_train.build_parser()
    group = next(g for g in parser._action_groups if g.title == "algorithm")
    assert {a.dest for a in group._group_actions} == set(algorithm.FLAGS)
    assert all(a.help for a in group._group_actions)
    assert algorithm.from_args(parser.parse_args([])) == Algorithm()
    assert set(algorithm.FLAGS) <= set(checkpoint.SAME_FLAGS)


def test_a_flag_the_older_run_lacked_counts_as_its_default():
    """A run saved before a flag existed resumes at that flag's default; at another value it is refused,
    saying which flag and both values."""
    defaults = vars(pivot_train.build_parser().parse_args([]))
    older = {k: v for k, v in defaults.items() if k != "clip_eps_high"}
    assert checkpoint.differing_flags(older, pivot_train.parse_args([]), defaults) == []
    assert checkpoint.differing_flags(older, pivot_train.parse_args(["--clip-eps-high", "0.28"]), defaults) == [
        "--clip-eps-high None -> 0.28"]
    assert checkpoint.differing_flags({**defaults, "kl_coef": 0.1}, pivot_train.parse_args([]), defaults) == [
        "--kl-coef 0.1 -> 0.0"]


def test_without_the_std_division_advantages_are_the_centred_rewards():
    algo = algorithm.from_args(pivot_train.parse_args(["--no-norm-adv-by-std"]))
    assert algo == Algorithm(norm_adv_by_std=False)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    assert algo.advantages(rewards).tolist() == [[0.75, -0.25, -0.25, -0.25], [0.0] * 4]
    assert Algorithm().advantages(rewards)[0].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-5)
