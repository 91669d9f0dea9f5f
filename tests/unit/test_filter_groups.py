"""--filter-groups (DAPO's dynamic sampling): groups whose G rewards are all equal leave the update, and
the step admits the next prompts of the data stream while it runs until it has --prompts-per-step
informative groups or has drawn --filter-groups-max-prompts. These tests drive rank 0's StepQueues by
hand, in many orders of completion; the runs are in tests/e2e/test_filter_groups_runs.py."""
import random

import numpy as np
import pytest

from algorithm import Algorithm
from roles.engine import Request
from roles.judge import Verdict
from roles.rollout import Sample, sample_seed
from shifting.book import IN_FLIGHT
from shifting.scheduler import Report, SamplingOptions, StepQueues, colocated_roles

G = 2
SAMPLING = SamplingOptions(group_size=G, seed=0, temperature=1.0, max_response_tokens=8, workload="task")
# Each candidate prompt's rewards, by hand: informative when they differ.
REWARDS = [[1, 1], [0, 1], [0, 0], [1, 1], [1, 0], [0, 1]]
PROMPTS = [{"prompt": f"{p}+1=", "prompt_ids": [3, 4 + p], "reference": None, "rubric": None} for p in range(6)]


def take(queues: StepQueues, role: str, i: int) -> Request:
    """Sample i's queued request, out of the book's queue onto an engine (as dispatch sends it)."""
    queues.book.queue[role].remove(i)
    queues.book.phase[i] = IN_FLIGHT[role]
    return queues.requests[i]


def dropped(queues: StepQueues) -> list[int]:
    """The groups left out of the update, by prompt index."""
    return np.flatnonzero(queues.book.dropped).tolist()


def run_step(queues: StepQueues, rewards, order: random.Random) -> dict:
    """Finishes queued requests one at a time, each drawn at random from those queued: a rollout becomes
    a sample with its judge request, a judge request a verdict with the hand-set reward. Returns the
    rollout requests in the order they were queued and every group handed to train on the way."""
    queued, handed = queues.queued("rollout"), []
    while not queues.done():
        pool = [(role, i) for role in ("rollout", "judge") for i in queues.book.queue[role]]
        request = take(queues, *pool[order.randrange(len(pool))])
        report = Report(request.role)
        if request.role == "rollout":
            prompt = PROMPTS[request.key[0]]["prompt"]
            sample = Sample(*request.key, request.prompt_ids, [5], [-1.0], "stop", prompt=prompt, step=request.step)
            report.responses.append((sample, Request("judge", request.key, [6], 8, 0.0, step=request.step)))
        else:
            p, g = request.key
            report.verdicts.append(Verdict(request.key, "", 1, 1, float(rewards[p][g]), False, True, 0, step=request.step))
        before = len(queues.book.queue["rollout"])
        queues.ingest([report], round_s=0.0)
        queued += queues.queued("rollout")[before:]
        handed += [group[0].prompt_index for group in queues.hand_to_train()]
    return {"queued": queued, "handed": set(handed)}


@pytest.mark.parametrize("seed", range(20))
def test_the_step_draws_the_shortest_prefix_with_enough_informative_groups_in_any_order(seed):
    """Wanting 2 informative groups of REWARDS: prompts 0 to 4 (1 and 4 informative; 0, 2, 3 left out,
    each admitting the next prompt in stream order), never prompt 5, whatever order requests finish in."""
    queues = StepQueues(PROMPTS, step=3, sampling=SAMPLING, algo=Algorithm(), filter_groups=2)
    assert [r.key for r in queues.queued("rollout")] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    seen = run_step(queues, REWARDS, random.Random(seed))
    # each replacement's G requests come together, in stream order, each with its own place's seed
    assert [r.key for r in seen["queued"]] == [(p, g) for p in range(5) for g in range(G)]
    assert [r.seed for r in seen["queued"]] == [sample_seed(0, 3, p, g) for p in range(5) for g in range(G)]
    assert dropped(queues) == [0, 2, 3]
    assert queues.update_book.ready() == [1, 4] and seen["handed"] <= {1, 4}  # only informative groups reach train
    assert sorted(queues.samples) == [(3, p, g) for p in range(5) for g in range(G)]
    assert queues.judge_runs == queues.book.expected == 5 * G  # each admitted prompt's G samples judged once
    assert [s.dropped for s in queues.ordered_samples()] == [p in (0, 2, 3) for p in range(5) for _ in range(G)]


def test_at_the_cap_the_step_keeps_the_informative_groups_it_has():
    """Three prompts at most, one of them informative: all three drawn, two left out, one to train."""
    queues = StepQueues(PROMPTS[:3], step=0, sampling=SAMPLING, algo=Algorithm(), filter_groups=2)
    run_step(queues, REWARDS, random.Random(0))
    assert dropped(queues) == [0, 2] and queues.update_book.ready() == [1] and queues.book.expected == 3 * G
    assert not queues.book.held


def test_without_the_filter_every_prompt_is_queued_and_none_left_out():
    queues = StepQueues(PROMPTS, step=0, sampling=SAMPLING, algo=Algorithm())
    run_step(queues, REWARDS, random.Random(1))
    assert dropped(queues) == [] and queues.update_book.ready() == list(range(6))


def test_colocated_ranks_finish_judging_before_rolling_out_what_was_admitted():
    queues = StepQueues(PROMPTS, step=0, sampling=SAMPLING, algo=Algorithm(), filter_groups=2)
    for i in list(queues.book.queue["rollout"]):
        request = take(queues, "rollout", i)
        sample = Sample(*request.key, request.prompt_ids, [5], [-1.0], "stop", step=request.step)
        queues.ingest([Report("rollout", responses=[(sample, Request("judge", request.key, [6], 8, 0.0))])], 0.0)
    judge = [take(queues, "judge", i) for i in list(queues.book.queue["judge"])[:2]]  # prompt 0's group, all 1: left out
    queues.ingest([Report("judge", verdicts=[Verdict(r.key, "", 1, 1, 1.0, False, True, 0, step=r.step) for r in judge])], 0.0)
    assert dropped(queues) == [0] and [r.key for r in queues.queued("rollout")] == [(2, 0), (2, 1)]
    rng = random.Random(0)
    assert colocated_roles(["judge"] * 2, queues, rng)[0] == ["judge"] * 2  # prompt 1 still to judge
    for i in list(queues.book.queue["judge"]):
        take(queues, "judge", i)
    assert colocated_roles(["judge"] * 2, queues, rng)[0] == ["rollout"] * 2
