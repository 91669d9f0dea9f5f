"""--max-staleness K > 0: the run-ahead rules of the scheduling book (shifting/book.py update_due,
publish_due, ahead_step) decide for the loop (rank 0's StepQueues, pivot_train.rollout_for_update) and
the simulator (sim/engine.py) alike. Each rule is replaced by a spy that records who asked it what, so a
side that decided by a rule of its own fails here; the loop is driven by hand, the simulator on a small
workload."""
import itertools
from collections import deque
from types import SimpleNamespace

import pytest

from algorithm import Algorithm
import pivot_train
import planner
from roles.rollout import Sample
from shifting.placement import Placement, PlacementOptions
from shifting.scheduler import NO_EARLY, Report, Room, Rounds, SamplingOptions, StepQueues, _decide
from sim import calibration as C
from sim.engine import RoundRules, Simulation, Step

G = 2
SAMPLING = SamplingOptions(group_size=G, seed=0, temperature=1.0, max_response_tokens=8, workload="task")
PROMPTS = [{"prompt": f"{p}+1=", "prompt_ids": [3, 4 + p]} for p in range(2)]
AHEAD = [{"prompt": f"{p}+2=", "prompt_ids": [5, 4 + p]} for p in range(2)]
POOL = [Sample(p, g, [3], [5], [-1.0], "stop", reward=float(g)) for p in range(2) for g in range(G)]
RULES = ("update_due", "publish_due", "ahead_step")


@pytest.fixture
def asked(book_calls):
    """Every call of the three rules: (the calling module, the rule, its arguments, its answer)."""
    return book_calls(*RULES)


def loop_queues(trained: bool, made: bool, published: bool, ahead: bool) -> StepQueues:
    """Rank 0's queues of a step whose train ranks work through an earlier step's groups, in the given
    state: both groups trained (`trained`) or one; the update made; published; a next step to begin."""
    queues = StepQueues(PROMPTS, step=3, sampling=SAMPLING, algo=Algorithm(), early_train=True, train_pool=POOL, version=1,
                        ahead=AHEAD if ahead else None)
    queues.ingest([Report("train", trained={**NO_EARLY, "groups": [(0, 0), (0, 1)] if trained else [(0, 0)]}, train_s=0.1)], 0.0)
    if made:
        queues.ingest([Report("train", update={"loss": 0.0})], 0.0)
    queues.published = published
    return queues


def test_the_loop_makes_and_publishes_the_update_by_the_book(asked):
    """In every state rank 0 asks the book, with that state, and does as it answers."""
    for trained, made, published, ahead in itertools.product((False, True), repeat=4):
        queues = loop_queues(trained, made, published, ahead)
        due = queues.update_due()
        assert asked[-1] == ("shifting.scheduler", "update_due", (True, trained, made), due)
        for making in (False, True):
            due = queues.publish_due(making)
            assert asked[-1] == ("shifting.scheduler", "publish_due", (made or making, published, ahead), due)
    # K = 0, or the pipeline's fill: the update trains no earlier step's groups, and waits for the step's end
    queues = StepQueues(PROMPTS, step=3, sampling=SAMPLING, algo=Algorithm(), early_train=True)
    assert not queues.update_due() and asked[-1][2][0] is False


def loop_ahead(max_staleness: int, steps: int, checkpoint_every: int = 0, updates: str = "step") -> dict[int, int | None]:
    """The loop over a run's updates (pivot_train.rollout_for_update, each step's rollout left out): the
    step rolled out beside each update, and the step it may begin."""
    args = SimpleNamespace(max_staleness=max_staleness, steps=steps, checkpoint_every=checkpoint_every,
                           updates=updates)
    begun, pending = {}, deque()

    def roll_out(step, train_pool, ahead=None):
        if train_pool is not None or not max_staleness:  # beside an update, not the pipeline's fill
            begun[step] = ahead
        return [step] if step < steps else [], {}, {key: 0 for key in pivot_train.FILL_COUNTS} | {"shifts": []}

    for update in range(steps):
        pivot_train.rollout_for_update(update, pending, roll_out, args)
    return begun


def test_the_loop_begins_ahead_the_step_the_book_says(asked):
    assert loop_ahead(2, 6) == {2: 3, 3: 4, 4: 5, 5: None, 6: None, 7: None}
    # ready-first: one step shallower, the step beside update u is u + 1
    assert loop_ahead(2, 6, updates="ready") == {1: 2, 2: 3, 3: 4, 4: 5, 5: None, 6: None}
    assert loop_ahead(1, 6, updates="ready") == loop_ahead(1, 6)
    assert loop_ahead(1, 6, checkpoint_every=2) == {1: 2, 2: None, 3: 4, 4: None, 5: None, 6: None}
    assert set(loop_ahead(0, 4).values()) == {None}
    assert {who for who, rule, _, _ in asked if rule == "ahead_step"} == {"pivot_train"}


def published(calls) -> list[int | None]:
    """What the rules' calls, in order, say was published during a step: the step begun with each
    publish (the last ahead_step asked; None where none was), each at the round the update was made (a
    round asks update_due, then publish_due)."""
    steps, ahead, last = [], None, None
    for _, rule, _, answer in calls:
        if rule == "ahead_step":
            ahead = answer
        elif rule == "publish_due" and answer:
            assert last == ("update_due", True), "published other than at the round the update was made"
            steps.append(ahead)
        last = rule, answer
    return steps


def keep(roles, queues, rng):
    """A plan that moves no rank."""
    return roles, Rounds()


@pytest.mark.parametrize("ahead", [True, False])
def test_the_loop_publishes_at_the_round_the_update_is_made(asked, ahead):
    """Rank 0's decisions (scheduler._decide), round by round: the train rank is handed the pool, reports
    it trained, is told to make the update and, in the same orders, every rank to publish it; it reports
    the update made."""
    queues = StepQueues(PROMPTS, step=3, sampling=SAMPLING, algo=Algorithm(), early_train=True, train_pool=POOL, version=1,
                        ahead=AHEAD if ahead else None)
    roles = ["rollout", "judge", "train"]
    reports = [[], [Report("train", trained={**NO_EARLY, "groups": [(0, 0), (0, 1)]}, train_s=0.1)],
               [Report("train", update={"loss": 0.0})], []]
    orders = [_decide([Report("rollout"), Report("judge"), *train], queues, keep, roles, None, Room(4), 0.0)
              for train in reports]
    assert [o[2].update is not None for o in orders] == [False, True, False, False]
    assert [o[0].publish for o in orders] == [None, 2 if ahead else None, None, None]
    assert published(asked) == ([None] if ahead else [])


@pytest.mark.parametrize("placement, max_staleness, steps", [("disaggregated", 1, 2), ("disaggregated", 2, 2),
                                                            ("pivot", 1, 2)])
def test_the_simulator_asks_the_book_and_begins_the_steps_the_loop_would(asked, monkeypatch, placement,
                                                                         max_staleness, steps):
    """Each update's ahead step is the one the loop gives over the same run; every round of a step asks
    whether to make the update, then whether to publish; what the simulator begins ahead it begins at
    the round the update is made, and only where the book says."""
    cal = C.load()
    model = C.GpuModel(cal, "dense-8b-32b")
    sim = Simulation(model, C.gpu_workload(cal, 4), 8, placement, max_staleness=max_staleness,
                     config=planner.PlannerConfig(early_train=True, min_train_ranks=model.min_train_slots),
                     rules=RoundRules(updates="step"))
    extended, extend = [], Step.extend
    monkeypatch.setattr(Step, "extend", lambda step, ahead: (extended.append(ahead.index), extend(step, ahead)))
    sim.run(steps)
    calls = list(asked)
    assert {who for who, _, _, _ in calls} == {"sim.engine"}
    # The simulator's updates are a window of a run one step longer (Simulation.run): the loop's --steps
    asked_ahead = {args[0]: answer for _, rule, args, answer in calls if rule == "ahead_step"}
    loop = loop_ahead(max_staleness, steps + max_staleness + 1)
    assert asked_ahead == {step: loop[step] for step in asked_ahead}
    assert asked_ahead[steps + max_staleness - 1] == steps + max_staleness  # the last timed step begins the next
    assert extended and extended == published(calls)


def test_an_update_not_made_during_the_step_is_made_after_it_by_the_slots_that_trained_it(monkeypatch):
    """As the loop does (pivot_train.to_train, then train_step; book.update_roles): where no round's start
    made the update, because its last groups were trained in the step's last round (this run's second
    update at seed 6), the train slots make it alone, no slot moving to train; where groups are left to
    train (the drain's), every pivot slot moves to train for them; one made during the step needs no move."""
    cal = C.preset(C.load(), "paper")
    model = C.FittedGpuModel(cal, "qwen25-1b5+glm-z1-9b")
    sim = Simulation(model, C.gpu_workload(cal, 8), 8, "pivot", max_staleness=2, seed=6,
                     config=planner.PlannerConfig(early_train=True, min_train_ranks=model.min_train_slots),
                     rules=RoundRules(updates="step"))
    moves, ends, apply, finish = [], [], sim._apply, sim._finish

    def record_apply(roles, grads):
        moves.append(list(roles))
        apply(roles, grads)

    def record_finish(step):
        made, trained, before = sim.made, step.through(), len(moves)
        finish(step)
        ends.append((made, trained, ["train"] * 8 in moves[before:]))

    monkeypatch.setattr(sim, "_apply", record_apply)
    monkeypatch.setattr(sim, "_finish", record_finish)
    sim.run(2)
    assert ends == [(True, True, False), (False, True, False), (False, False, True), (False, False, True)]  # the drain


def test_the_loop_and_the_simulator_choose_who_makes_the_update_by_the_book(book_calls):
    """pivot_train.to_train (through Placement.train_roles) and the simulator's step end both ask
    book.update_roles, with rank 0's answer to whether the train ranks make the update alone
    (Placement.update_alone, planner.update_seconds): with nothing left to train, always; with much left,
    not, since every rank trains it faster."""
    asked = book_calls("update_roles")
    options = PlacementOptions(placement="pivot", split=None, max_staleness=2, force_shifts=None, force_shift_rate=0.2,
                               minibatches=1, max_seqs=8, max_response_tokens=8, max_critique_tokens=8, seed=0)
    placement = Placement(options, world_size=2)
    left = lambda tokens: SimpleNamespace(update_book=SimpleNamespace(train_work=lambda: (tokens, tokens, 0)))  # noqa: E731
    # The priors, 2,000 tokens/s per rank and 0.01 s a shift: alone is no slower up to 40 tokens left
    # (t / 2000 against 0.01 + t / 4000).
    assert [placement.update_alone(["train", "judge"], left(t)) for t in (0, 30, 50, 1000)] == [True, True, False, False]
    assert not placement.update_alone(["judge", "judge"], left(0))  # no train rank holds the update
    context = SimpleNamespace(roles=["train", "judge"], apply=lambda roles: roles)
    assert pivot_train.to_train(context, placement, {"alone": True}) == ["train", "judge"]
    assert pivot_train.to_train(context, placement, {"alone": False}) == ["train", "train"]
    cal = C.preset(C.load(), "paper")
    model = C.FittedGpuModel(cal, "qwen25-1b5+glm-z1-9b")
    Simulation(model, C.gpu_workload(cal, 8), 8, "pivot", max_staleness=2, rules=RoundRules(updates="step"),
               config=planner.PlannerConfig(early_train=True, min_train_ranks=model.min_train_slots)).run(2)
    assert {who for who, _, _, _ in asked} == {"shifting.placement", "sim.engine"}


def test_pivot_at_k_above_0_begins_each_step_in_the_roles_its_rounds_ended_with(monkeypatch):
    """book.next_step_roles, for the loop (Placement.step_roles, which pivot_train.publish_and_reload
    applies) and the simulator's step end alike: at K > 0 pivot's train slots stay in train into the next
    step, whose update's groups are judged and theirs at once, as do its engine slots; at K = 0, under
    --force-shifts and for a fixed split the step begins as the run did."""
    options = dict(placement="pivot", split=None, max_staleness=2, force_shifts=None, force_shift_rate=0.2,
                   minibatches=1, max_seqs=8, max_response_tokens=8, max_critique_tokens=8, seed=0)
    held = ["train", "rollout", "judge"]
    assert Placement(PlacementOptions(**options), world_size=3).step_roles(held) == held
    for change in ({"max_staleness": 0}, {"force_shifts": 1}):
        assert Placement(PlacementOptions(**{**options, **change}), world_size=3).step_roles(held) == ["rollout"] * 3
    split = PlacementOptions(**{**options, "placement": "disaggregated", "split": ("rollout", "judge", "train")})
    assert Placement(split, world_size=3).step_roles(held) == ["rollout", "judge", "train"]

    cal = C.preset(C.load(), "paper")
    model = C.FittedGpuModel(cal, "qwen25-1b5+glm-z1-9b")
    sim = Simulation(model, C.gpu_workload(cal, 8), 8, "pivot", max_staleness=2, seed=0,
                     config=planner.PlannerConfig(early_train=True, min_train_ranks=model.min_train_slots))
    ends, finish = [], sim._finish

    def record_finish(step):
        made, ended = sim.made, [s.role for s in sim.slots]
        finish(step)
        ends.append((made, ended, [s.role for s in sim.slots]))

    monkeypatch.setattr(sim, "_finish", record_finish)
    sim.run(2)
    made = [(ended, begun) for was_made, ended, begun in ends if was_made]
    assert made and any("train" in ended for ended, _ in made)
    assert all(begun == ended for ended, begun in made)
