"""A rank that leaves an engine role with requests in flight: they go on in the round it leaves in, on the
ranks that hold their role (scheduler.py Orders.migrate, StepQueues.migrate), not a round later; the
simulator does the same (RoundRules.migrate_at_once)."""
from dataclasses import replace

import planner
from algorithm import Algorithm
from shifting.scheduler import Report, Room, Rounds, SamplingOptions, StepQueues, _decide
from sim import calibration as C
from sim.engine import RoundRules, Simulation

G = 2
SAMPLING = SamplingOptions(group_size=G, seed=0, temperature=1.0, max_response_tokens=8, workload="task")
PROMPTS = [{"prompt": f"{p}+1=", "prompt_ids": [3, 4 + p]} for p in range(2)]


def to(roles):
    """A plan that gives the ranks `roles`, rounds timed."""
    return lambda _roles, _queues, _rng: (list(roles), Rounds(seconds=1.0, early=True))


def test_the_loop_hands_a_leaving_ranks_requests_out_in_the_round_it_leaves():
    queues = StepQueues(PROMPTS, step=0, sampling=SAMPLING, algo=Algorithm(), ranks=2)
    first = _decide([Report("rollout"), Report("rollout")], queues, to(["rollout"] * 2), ["rollout"] * 2, None,
                    Room(4), 0.0)
    assert [len(o.work) for o in first] == [2, 2] and not any(o.migrate for o in first)
    # Both ranks generated a token of each request; rank 1 goes to the judge.
    left = [replace(r, generated=[5]) for r in first[1].work]
    reports = [Report("rollout", generated=[1, 1]), Report("rollout", generated=[1, 1])]
    second = _decide(reports, queues, to(["rollout", "judge"]), ["rollout"] * 2, None, Room(4), 0.0)
    assert all(o.migrate for o in second) and all(o.work == [] for o in second)  # the work comes with the exports
    work = queues.migrate([[], left], Room(4))
    assert work == [left, []]  # they go on at once on rank 0, which has room for them
    assert queues.migrated == 2 and queues.deferred is None
    # Leaving with nothing in flight needs no migration: the work comes with the orders.
    reports = [Report("rollout", generated=[1, 1, 2, 2]), Report("judge")]
    third = _decide(reports, queues, to(["rollout", "rollout"]), ["rollout", "judge"], None, Room(4), 0.0)
    assert not any(o.migrate for o in third)


def test_the_judges_prefill_budget_counts_the_sequences_a_leaving_rollout_rank_hands_over():
    """At K = 0 a judge engine prefills no more than it can before the rollout engines run empty
    (book.prefill_budget), where what they run includes what a rank leaving rollout handed over: its
    requests, requeued as it left, are shared among the rollout ranks before the judge's budget is set, as
    the simulator's slots hold them (Simulation._until_empty)."""
    asked = []

    class Recorded(Room):
        def budget(self, role, seconds, rollout_running):
            asked.append((role, rollout_running()))

    queues = StepQueues(PROMPTS, step=0, sampling=SAMPLING, algo=Algorithm(), ranks=2)
    first = _decide([Report("rollout"), Report("rollout")], queues, to(["rollout"] * 2), ["rollout"] * 2, None,
                    Room(4), 0.0)
    left = [replace(r, generated=[5] * (3 + k)) for k, r in enumerate(first[0].work)]
    reports = [Report("rollout", generated=[3, 4]), Report("rollout", generated=[1, 2])]
    _decide(reports, queues, to(["judge", "rollout"]), ["rollout"] * 2, None, Room(4), 0.0)
    queues.migrate([left, []], Recorded(4))
    assert dict(asked)["judge"] == [[1, 2, 3, 4]]  # rank 1's own two, then rank 0's, with their tokens so far
    # Work no rollout engine has room for waits in the queue: then no estimate.
    asked.clear()
    queues = StepQueues(PROMPTS, step=0, sampling=SAMPLING, algo=Algorithm(), ranks=2)
    queues.dispatch(["judge", "rollout"], Recorded(1), [0, 0], 1.0)
    assert dict(asked)["judge"] == []


def test_the_simulator_runs_a_leaving_slots_sequences_in_the_round_it_leaves(monkeypatch):
    """Pivot on 8 slots: every sequence a shift exports runs on a slot of its role in the same round, unless
    the role's slots are full; with the rule off, none does."""
    cal = C.load()
    model = C.GpuModel(cal, "dense-8b-32b")

    def exports(rules) -> list[tuple[bool, bool]]:
        """For each sequence a shift exported: whether it runs in that round, whether its role's slots are full."""
        sim = Simulation(model, C.gpu_workload(cal, 4), 8, "pivot", config=planner.PlannerConfig(
            early_train=True, min_train_ranks=model.min_train_slots), rules=rules)
        exported, seen, shift, start = [], [], Simulation._shift, Simulation._round

        def shifting(self, slot, role, train_slots, grads):
            if slot.role != role:
                exported.extend((i, slot.role) for i in slot.running)
            shift(self, slot, role, train_slots, grads)

        def round_(self, rnd):
            running = {i for s in self.slots for i in s.running}
            full = {role: all(len(s.running) >= self._capacity(role, rnd.seconds) for s in self.slots if s.role == role)
                    for role in ("rollout", "judge")}
            seen.extend((i in running, full[role]) for i, role in exported)
            exported.clear()
            return start(self, rnd)

        monkeypatch.setattr(Simulation, "_shift", shifting)
        monkeypatch.setattr(Simulation, "_round", round_)
        sim.run(1)
        return seen

    seen = exports(RoundRules())
    assert seen and all(running or full for running, full in seen)
    assert not any(running for running, _ in exports(RoundRules(migrate_at_once=False)))
