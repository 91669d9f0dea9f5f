"""The scheduling book's rules (shifting/book.py), which the loop and the simulator both call."""
import sys
from collections import deque
from dataclasses import replace

import numpy as np
import pytest

from algorithm import Algorithm
import planner
from shifting.book import (Book, RecentSteps, ahead_step, colocated_role, empty_enough, intake, migrates,
                           prefill_budget, publish_due, rank_roles, requeue, round_seconds, shares, slot_ranks,
                           slot_shape, update_due, update_roles, within_budget)
from shifting.scheduler import Report, Room, SamplingOptions, StepQueues, colocated_roles
from sim import calibration as C
from sim.engine import Simulation, Step


def test_shares_even_out_loads_up_to_capacity():
    assert shares(128, [0, 0], 64) == [64, 64]
    assert shares(5, [0, 0], 64) == [3, 2]  # the lower rank among equals first
    # A rank run empty beside a full one takes the whole queue, up to its room.
    assert shares(64, [0, 64], 64) == [64, 0]
    assert shares(80, [0, 64], 64) == [64, 0]
    assert shares(10, [50, 44, 60], 64) == [2, 8, 0]  # rank 1 to 50 first, then turn about: 52, 52, 60
    assert shares(0, [1, 2], 64) == [0, 0]
    assert shares(3, [], 64) == []


def test_a_judge_engine_takes_in_what_it_steps_well_or_its_even_share():
    # An engine step of 0.006 s + 0.0002 s a sequence doubles its fixed part at 30 sequences.
    assert intake("judge", 0.006, 0.0002, 128, 1000, 128) == 30
    assert intake("judge", 0.006, 0.0002, 128, 1000, 128, knee=2.0) == 60
    # Never below the role's sequences shared over every rank, nor above the engine's room.
    assert intake("judge", 0.006, 0.0002, 128, 8000, 128) == 63
    assert intake("judge", 0.006, 0.0002, 128, 100000, 128) == 128
    assert intake("judge", 0.006, 0.0, 128, 10, 128) == 128  # no cost a sequence measured: its room
    assert intake("judge", 0.0, 0.001, 128, 0, 128) == 1  # one at least
    # A rollout engine takes its room: a step's prompts are queued at its start, when none is to join.
    assert intake("rollout", 0.006, 0.0002, 128, 1000, 128) == 128


def test_a_judge_engine_takes_in_what_it_finishes_within_the_round():
    # Critiques of 10 tokens in a round of 0.5 s: 0.05 s a critique's worth of steps, 0.044 s of it
    # beyond the fixed part, 220 sequences at 0.0002 s each: more than the knee's 30, up to the room.
    assert intake("judge", 0.006, 0.0002, 128, 1000, 128, 0.5, 10.0) == 128
    assert intake("judge", 0.006, 0.0002, 256, 1000, 128, 0.5, 10.0) == 220
    # Critiques as long as the round or longer: the knee's batch, as with an untimed round.
    assert intake("judge", 0.006, 0.0002, 128, 1000, 128, 0.5, 100.0) == 30
    assert intake("judge", 0.006, 0.0002, 128, 1000, 128, None, 10.0) == 30


def test_work_beyond_the_intake_waits_for_a_rank_that_joins():
    book = Book(200, 4)
    book.queue["judge"].extend(book.queue["rollout"])
    book.queue["rollout"].clear()
    book.phase[:] = 2  # every response finished, waiting for the judge
    cap = intake("judge", 0.006, 0.0002, 128, 200, 16)
    assert [len(w) for w in book.dispatch("judge", [0, 0], cap)] == [30, 30]
    assert len(book.queue["judge"]) == 140
    # A rank that joins the judge a round later takes work in its first round, up to the intake.
    assert [len(w) for w in book.dispatch("judge", [25, 30, 0], cap)] == [5, 0, 30]


def test_a_judge_engine_at_k0_takes_in_what_it_prefills_in_a_timed_round_and_the_rest_waits_in_order():
    assert prefill_budget("judge", True, 0.5, 1000.0) == 500.0
    assert prefill_budget("judge", True, None, 1000.0) is None  # an untimed round: up to the intake
    assert prefill_budget("judge", False, 0.5, 1000.0) is None  # K > 0
    assert prefill_budget("rollout", True, 0.5, 1000.0) is None
    assert prefill_budget("rollout", True, 0.5, 1000.0, roles=("rollout", "judge")) == 500.0  # a what-if's roles
    # Rollout engines expected to run empty in 0.1 s end the round then: what it prefills by then.
    assert prefill_budget("judge", True, 0.5, 1000.0, until_empty_s=lambda: 0.1) == 100.0
    assert prefill_budget("judge", True, 0.5, 1000.0, until_empty_s=lambda: 2.0) == 500.0
    assert prefill_budget("judge", True, 0.5, 1000.0, until_empty_s=lambda: None) == 500.0  # too few to end it
    assert prefill_budget("judge", False, 0.5, 1000.0, until_empty_s=lambda: 0.1) is None
    assert within_budget([200.0, 200.0, 200.0], 500.0) == 2
    assert within_budget([900.0, 10.0], 500.0) == 1  # the first whatever its size
    assert within_budget([], 500.0) == 0 and within_budget([900.0, 10.0], None) == 2
    book = Book(12, 4)
    book.queue["judge"].extend(book.queue["rollout"])
    book.queue["rollout"].clear()
    book.phase[:] = 2
    assert book.dispatch("judge", [0, 0], 8, 250.0, lambda i: 100.0) == [[0, 1], [6, 7]]
    assert list(book.queue["judge"]) == [2, 3, 4, 5, 8, 9, 10, 11]  # back at the head, in order
    assert (book.phase[[0, 1, 6, 7]] == 3).all() and (book.phase[[2, 3, 4, 5, 8, 9, 10, 11]] == 2).all()


def test_round_seconds_and_early_end():
    assert round_seconds(25, None, 0.0, 0.0) == 25 * 0.002
    assert round_seconds(25, 0.01, 0.0, 0.0) == 0.25
    assert round_seconds(25, 0.01, 0.0, 0.1) == 2.0  # 20 exchanges
    assert round_seconds(25, 0.01, 0.5, 0.0) == 5.0  # 10 of the longest step
    assert [empty_enough(n) for n in (1, 2, 8, 9, 128)] == [1, 1, 1, 2, 16]


def test_run_ahead_rules():
    assert update_due(True, True, False)  # an earlier step's groups, all trained early: made now
    assert not update_due(True, True, True)  # once
    assert not update_due(True, False, False) and not update_due(False, True, False)
    assert publish_due(True, False, True)  # made, not out yet, a next step to begin
    assert not publish_due(True, True, True) and not publish_due(False, False, True)
    assert not publish_due(True, False, False)  # nothing to begin: it goes out at the step's end
    assert ahead_step(3, 1, 10, False) == 4
    assert ahead_step(3, 0, 10, False) is None  # on-policy: nothing runs ahead
    assert ahead_step(3, 2, 4, False) is None  # the run's last step: none left to begin
    assert ahead_step(3, 2, 10, True) is None  # the update ends in a checkpoint: whole steps only


def test_who_makes_an_update_after_the_step():
    r, j, t = "rollout", "judge", "train"
    assert update_roles([t, r, j, j], None, True) == [t, r, j, j]  # every group trained early: its train ranks
    assert update_roles([t, r, j, j], None, False) == [t] * 4  # groups left: every rank
    assert update_roles([r, r, j, j], None, True) == [t] * 4  # no train rank holds the gradients
    assert update_roles([j, j, r, r], [r, r, j, t], False) == [r, r, j, t]  # a split keeps its roles


def test_the_step_begun_ahead_is_the_one_the_loop_and_the_simulator_each_had():
    """ahead_step against the rules each side wrote before they called it: the loop began the next step's
    prompts (`prompts(step, later=1) or None`: none at or past --steps) at K > 0 unless the update ended
    in a checkpoint; the simulator `beside + 1 if k and beside + 1 < last else None`."""
    for k in range(4):
        for steps in range(1, 8):
            for step in range(steps + k):
                loop = step + 1 if k > 0 and step + 1 < steps else None
                assert ahead_step(step, k, steps, False) == loop == (step + 1 if k and step + 1 < steps else None)
                assert ahead_step(step, k, steps, True) is None


def test_recent_steps_keep_the_last_ones_their_lower_median_and_the_longest():
    assert RecentSteps(ranks=3, keep=4).keep == 12  # so many per rank
    recent = RecentSteps(keep=4)
    assert recent.median() is None and recent.longest() == 0.0
    for seconds in (0.5, 0.1, 0.3, 0.2):
        recent.add(seconds)
    assert recent.median() == 0.2 and recent.longest() == 0.5  # the lower of the middle two
    recent.add(0.1, count=3)  # a run of three steps at one speed: 0.5, 0.1 and 0.3 leave
    assert recent.count == 4 and recent.median() == 0.1 and recent.longest() == 0.2
    recent.add(0.9, count=100)  # a run longer than what is kept keeps its last four
    assert list(recent.runs) == [[0.9, 4]] and recent.median() == 0.9


def test_exported_work_goes_first_in_the_order_it_was_exported():
    queue = deque([7, 8])
    requeue(queue, [3, 1, 2])
    assert list(queue) == [3, 1, 2, 7, 8]
    requeue(queue, [])
    assert list(queue) == [3, 1, 2, 7, 8]


def test_a_response_at_the_bound_is_judged_before_younger_steps_responses():
    """--updates ready: a response of a group carried in from the step before (at the bound: it trains in
    the next update or breaks it) queues for the judge ahead of the step's own, and the step's own ahead
    of those of the step begun during it; within each, in the order they finished. Without a step carried
    in or begun ahead the queue is in the order responses finished, as at K = 0."""
    head, ahead = Book(8, 2), Book(4, 2)
    head.carried_in = 1  # samples 0-1
    head.extend(ahead)  # samples 8-11
    head.dispatch("rollout", [0], 12)
    for i in (9, 4, 0, 10, 5, 8, 1, 6, 2):
        head.respond(i, 10.0)
    assert list(head.queue["judge"]) == [0, 1, 4, 5, 6, 2, 9, 10, 8]
    head.dispatch("judge", [0], 2)
    head.retry(1)  # a critique to write again keeps its place among the carried-in
    assert list(head.queue["judge"]) == [1, 4, 5, 6, 2, 9, 10, 8]
    plain = Book(6, 2)
    plain.dispatch("rollout", [0], 6)
    for i in (5, 0, 3, 1):
        plain.respond(i, 10.0)
    assert list(plain.queue["judge"]) == [5, 0, 3, 1]


def test_colocated_rolls_out_then_judges_and_stays_while_judging():
    assert colocated_role("rollout", rollout_left=True, judging=True) == "rollout"
    assert colocated_role("rollout", rollout_left=False, judging=True) == "judge"
    assert colocated_role("judge", rollout_left=True, judging=True) == "judge"  # admitted prompts wait
    assert colocated_role("judge", rollout_left=True, judging=False) == "rollout"


@pytest.fixture
def asked(monkeypatch):
    """The calls of book.Book.colocated: (the calling module, its arguments, its answer)."""
    calls, rule = [], Book.colocated

    def spy(self, *args):
        answer = rule(self, *args)
        calls.append((sys._getframe(1).f_globals["__name__"], args, answer))
        return answer
    monkeypatch.setattr(Book, "colocated", spy)
    return calls


def test_the_loop_and_the_simulator_keep_one_book():
    """Rank 0's queues (StepQueues) and the simulator's step (Step) hold the same book.Book, which the
    simulator's Step only adds drawn lengths to: the same dispatch and exports leave the same order in
    each role's queue, the exported work first."""
    sampling = SamplingOptions(group_size=2, seed=0, temperature=1.0, max_response_tokens=8, workload="task")
    queues = StepQueues([{"prompt": f"{p}+1=", "prompt_ids": [3, 4 + p]} for p in range(3)], step=0,
                        sampling=sampling, algo=Algorithm())
    cal = C.load()
    step = Step(replace(C.gpu_workload(cal, 3), group_size=2), np.random.default_rng(0))
    assert isinstance(queues.book, Book) and isinstance(step, Book) and step.n == queues.book.n == 6
    overridden = {name for name in vars(Step) if name in vars(Book) and not name.startswith("__")}
    assert overridden == {"SAMPLE_ARRAYS"}  # it adds arrays, and no rule
    keys = [r.key for r in queues.queued("rollout")]
    running = queues.dispatch(["rollout", "rollout"], Room(2), [0, 0])  # four of six go to two engines
    assert step.dispatch("rollout", [0, 0], 2) == [[queues.number(r) for r in work] for work in running]
    queues.requeue([running[1][0], running[0][0], running[1][1]])
    step.requeue([2, 0, 3])
    assert [r.key for r in queues.queued("rollout")] == [keys[i] for i in step.queue["rollout"]] \
        == [keys[i] for i in (2, 0, 3, 4, 5)]


def test_the_loop_and_the_simulator_choose_colocated_roles_by_the_book(asked):
    sampling = SamplingOptions(group_size=2, seed=0, temperature=1.0, max_response_tokens=8, workload="task")
    queues = StepQueues([{"prompt": "1+1=", "prompt_ids": [3, 4]}], step=0, sampling=sampling, algo=Algorithm())
    assert colocated_roles(["rollout", "rollout"], queues, None)[0] == ["rollout", "rollout"]
    cal = C.load()
    model = C.GpuModel(cal, "dense-8b-32b")
    Simulation(model, C.gpu_workload(cal, 2), 4, "colocated",
               config=planner.PlannerConfig(early_train=True, min_train_ranks=model.min_train_slots)).run(1)
    assert {who for who, _, _ in asked} == {"shifting.scheduler", "sim.engine"}


def test_a_training_rank_counts_among_the_ranks_working_beside_an_engine_step():
    """The engine-step rows the CPU cost model is fitted on (bench/placements.py) key each step by the ranks
    that worked in its round: on shared cores a rank training early slows the engines as one stepping does,
    and the simulator's contention counts its train slots so (Simulation._busy)."""
    sampling = SamplingOptions(group_size=2, seed=0, temperature=1.0, max_response_tokens=8, workload="task")
    queues = StepQueues([{"prompt": "1+1=", "prompt_ids": [3, 4]}], step=0, sampling=sampling, algo=Algorithm())
    queues.ingest([Report("judge", engine_steps=[(8, 0.02, 0)]), Report("train", train_s=0.5), Report("rollout")],
                  round_s=0.6)
    queues.ingest([Report("judge", engine_steps=[(8, 0.01, 0)]), Report("judge", engine_steps=[(4, 0.01, 0)])],
                  round_s=0.3)
    assert queues.engine_metrics()["engine_steps"]["judge"] == [[2, 4, 1, 0.01, 0], [2, 8, 2, 0.03, 0]]


def test_the_planner_is_told_what_of_the_update_is_generated_and_what_is_still_to_come():
    """book.Book.train_work, which the loop's LoopPlanner and the simulator both tell the planner: tokens of
    the groups judged and not trained, of the samples generated and not trained, and how many are to come
    (a length counts once generated: neither side knows one before)."""
    b = Book(6, 2)  # three groups of two
    assert b.dispatch("rollout", [4], 8) == [[0, 1, 2, 3]]  # an engine with room for four more
    for i, tokens in ((0, 10), (1, 20), (2, 30)):
        b.respond(i, tokens)
    assert b.train_work() == (0.0, 60.0, 3)  # samples 3 (rolling), 4 and 5 (queued) to come
    b.dispatch("judge", [0], 8)
    assert b.judge(0) is False and b.judge(1) is True and b.ready() == [0]
    assert b.train_work() == (30.0, 60.0, 3)
    b.train([0])
    assert b.train_work() == (0.0, 30.0, 3) and not b.through()
    with pytest.raises(AssertionError, match="trained twice"):
        b.train([0])


def test_steps_begun_one_after_another_join_the_book_in_order_and_leave_it_one_at_a_time():
    """Two next steps begun during a step (the simulator's deep_pipeline): each one's samples follow those
    begun before it, its verdicts count in its own book, and each step's end carries the rest, the
    sequences exported first."""
    head, second, third = Book(4, 2), Book(4, 2), Book(4, 2)
    head.extend(second)
    head.extend(third)
    assert list(head.queue["rollout"]) == list(range(12)) and len(head.phase) == 12
    head.dispatch("rollout", [0], 12)
    for i in range(12):
        head.respond(i, 10.0 + i)
    head.dispatch("judge", [0], 12)
    assert [head.judge(i) for i in (9, 8, 0, 1, 2, 3)] == [False, True, False, True, False, True]
    assert head.done() and third.judged == 2 and second.judged == 0 and head.judging_left()
    assert head.ready() == [0, 1]  # its own groups alone
    nxt = head.carry([5, 4, 6, 7, 10, 11])  # every sequence in flight, as a step's end exports them
    assert nxt is second and nxt.aheads == [third] and list(nxt.queue["judge"]) == [1, 0, 2, 3, 6, 7]
    assert nxt.tokens.tolist() == [14.0 + i for i in range(8)] and nxt.group_left.tolist() == [2, 2, 0, 2]
    nxt.dispatch("judge", [0], 12)
    for i in (0, 1, 2, 3):
        nxt.judge(i)
    last = nxt.carry([6, 7])
    assert last is third and last.aheads == [] and list(last.queue["judge"]) == [2, 3]
    assert last.judged == 2 and last.group_left.tolist() == [0, 2] and last.tokens.tolist() == [18.0, 19.0, 20.0, 21.0]


def test_a_slot_is_the_widest_engine_s_ranks_and_holds_one_role():
    """--engine-tp 2 on six ranks: slots {0, 1}, {2, 3}, {4, 5}, each one engine of either role; the simulator's
    slot of a group whose judge spans 4 GPUs and policy 1 runs four policy engines."""
    assert slot_shape({"rollout": 2, "judge": 2}) == (2, {"rollout": 1, "judge": 1})
    assert slot_shape({"rollout": 1, "judge": 4}) == (4, {"rollout": 4, "judge": 1})
    with pytest.raises(ValueError, match="a rollout engine of 3 ranks does not divide a slot of 4"):
        slot_shape({"rollout": 3, "judge": 4})
    assert [list(slot_ranks(s, 2)) for s in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert rank_roles(["judge", "rollout", "train"], 2) == ["judge", "judge", "rollout", "rollout", "train", "train"]


def test_the_simulator_lays_out_its_slots_by_the_book(book_calls):
    asked = book_calls("slot_shape")
    model = C.GpuModel(C.load(), "moe-235b-a22b-32b")  # a policy engine of 8 GPUs, judge engines of 1
    assert (model.slot_gpus, model.instances) == (8, {"rollout": 1, "judge": 8})
    assert [(module, answer) for module, _, _, answer in asked] == [("sim.calibration", (8, {"rollout": 1, "judge": 8}))]


def test_a_round_migrates_where_a_rank_leaves_its_role_with_requests_in_flight():
    assert migrates(["rollout", "rollout"], [3, 2], ["rollout", "judge"])
    assert not migrates(["rollout", "rollout"], [3, 0], ["rollout", "judge"])  # it left with none
    assert not migrates(["rollout", "judge"], [3, 2], ["rollout", "judge"])  # no rank moves
