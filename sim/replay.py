"""A recorded run of the loop replayed through the simulator's book.

    python -m sim.replay placements.json      (bench/placements.py's JSON: its runs' rounds and cost model)
    python -m sim.replay placements.json --run RUN   (a pivot_train.py --trace-rounds run in RUN)

pivot_train.py --trace-rounds writes what its rank 0 read and ordered in every round (rounds.jsonl;
bench/placements.py keeps its first repeat's in its JSON). Here the simulator (sim/engine.py) runs the same
steps with its slots in the loop's roles, and in each round they finish, export and train what the loop's
ranks did; everything the loop's rank 0 decided from those reports the simulator decides by its own
code: the samples each rank takes, the groups handed to train, when the update is made and published,
whether a round is timed, when the step ends and what it carries into the next. Each difference is a
rule the two do not share; none is the answer (tests/unit/test_replay.py).
"""
import argparse
import json
import sys
from collections import deque
from dataclasses import replace
from pathlib import Path

import planner
from roles import ROLES, Role
from sim.calibration import CpuModel, cpu_workload, load
from sim.engine import Round, RoundRules, Simulation


class Diverged(Exception):
    """The simulator wants a round the loop did not have, or gave a rank none of what it then finished:
    what follows cannot be compared."""


class Replay(Simulation):
    """The simulator stepped by a recorded run's rounds instead of its clock and cost model: the slots
    take the recorded roles and the recorded reports, and every difference between what the simulator
    then orders and what the loop ordered is kept in `differences`."""

    def __init__(self, model, workload, slots: int, placement: str, max_staleness: int,
                 split: dict[str, int] | None = None, updates: str = "step"):
        config = planner.PlannerConfig(early_train=True, min_train_ranks=model.min_train_slots)
        super().__init__(model, workload, slots, placement, config=config, max_staleness=max_staleness, split=split,
                         rules=RoundRules(updates=updates))
        self.differences: list[str] = []

    def replay(self, steps: list[dict]) -> list[str]:
        """`steps`: rounds.jsonl's lines, in the order the loop rolled the steps out."""
        pending, self.carried = deque(), None
        for line in steps:
            self.where = f"step {line['step']}"
            if line["carried"]:
                rolled = self.carried
                self._same(rolled is not None, True, "a carried step")
                if rolled is None:
                    return self.differences
            else:  # a step of the pipeline's drain rolls nothing out
                rolled = self._new_step(line["step"], version=0) if line["samples"] else None
            update = (pending.popleft() if line["train_pool"] else None) if self.max_staleness else rolled
            self.ahead_index = line["step"] + 1 if line["ahead"] else None
            self.update = update
            self._same(self._early_train(), line["early_train"], "early training")
            self.recorded, self.carried, self.count = deque(line["rounds"]), None, len(line["rounds"])
            self.made_seen = self.published_seen = False
            try:
                self._step(rolled, update)
            except Diverged:
                return self.differences  # every later step begins with this one's work
            done = self.recorded.popleft() if self.recorded else {}
            self._same(done.get("done", False), True, "the step's end")
            if self.carried is not None:
                self._same(self.exported_at_end, self.recorded.popleft().get("carry") if self.recorded else None,
                           "the requests carried into the next step")
            self._same(len(self.recorded), 0, "rounds left over")
            if self.max_staleness and rolled is not None:
                pending.append(rolled)
        return self.differences

    def _same(self, simulated, recorded, what: str) -> None:
        if simulated != recorded:
            self.differences.append(f"{self.where}: {what}: simulated {simulated}, recorded {recorded}")

    def _orders(self) -> tuple[list[str], Round]:
        """The recorded roles (pivot's come from its planner, which times the loop's rounds cannot replay);
        colocated's and disaggregated's, and whether the round is timed, the simulator's own."""
        roles, rnd = super()._orders() if self.placement != "pivot" else (None, None)
        rec = self.recorded[0] if self.recorded else {}
        if "roles" not in rec:
            self._same("another round", "the step's end", "the step's end")
            raise Diverged
        if roles is not None:
            self._same(roles, rec["roles"], f"{self._at()}: roles")
            self._same(rnd.seconds is not None, rec["timed"], f"{self._at()}: timed")
        return rec["roles"], Round(1.0 if rec["timed"] else None, early=rec["timed"])

    def _at(self) -> str:
        """The round of the step whose record comes next, counted from 0 as the loop's trace holds them."""
        return f"round {self.count - len(self.recorded)}"

    def _capacity(self, role: str, seconds: float | None) -> int:
        """Pivot's intake as the loop's rank 0 took it (from its planner's fits, which the times give; a
        recording that keeps none took each engine's room); the others' the simulator's own."""
        if self.placement != "pivot":
            return super()._capacity(role, seconds)
        recorded = self.recorded[0].get("capacity") if self.recorded else None
        return recorded[role] if recorded else self.model.max_seqs[role]

    def _budget(self, role: str, rnd: Round) -> float | None:
        """None: pivot's prefill budget (book.prefill_budget) counts the loop's own context tokens, which the
        simulator's drawn lengths are not, so `_dispatch` checks its cut against the recording instead."""
        return None if self.placement == "pivot" else super()._budget(role, rnd)

    def _dispatch(self, rnd: Round) -> None:
        """The simulator's shares (book.Book.dispatch, before any budget). Where the loop set a prefill
        budget, each rank's recorded take must be what the budget keeps of its share: a start of it, one
        request at least (book.within_budget); the rest goes back to the head of the queue, in order, as
        the loop's went."""
        before = [len(s.running) for s in self.slots]
        super()._dispatch(rnd)
        self.dispatched = [s.running[n:] for s, n in zip(self.slots, before)]
        rec = self.recorded[0] if self.recorded else {}
        if self.placement != "pivot" or "work" not in rec:
            return
        budgets = rec.get("budget") or {}
        cut = [budgets.get(slot.role) is not None and recorded != taken
               for slot, taken, recorded in zip(self.slots, self.dispatched, rec["work"])]
        if not any(cut) or any(c and (taken[:len(recorded)] != recorded or not recorded)
                               for c, taken, recorded in zip(cut, self.dispatched, rec["work"])):
            return  # nothing cut, or a take that is not a cut of its share: `_round` reports the difference
        back = []
        for c, slot, n, taken, recorded in zip(cut, self.slots, before, self.dispatched, rec["work"]):
            if c:
                slot.running, back = slot.running[:n + len(recorded)], back + taken[len(recorded):]
        self.step.requeue(back)
        self.dispatched = [s.running[n:] for s, n in zip(self.slots, before)]

    def _round(self, rnd: Round) -> bool:
        """Compares the round's orders with the loop's, then applies the loop's next reports: what each
        rank finished, and the groups the train ranks trained."""
        at, rec = self._at(), self.recorded.popleft()
        self._same(self.dispatched, rec["work"], f"{at}: the samples each rank takes")
        self._same([group for group, _, _ in self.train_groups], rec["handed"], f"{at}: the groups handed to train")
        self._same(self.published and not self.published_seen, rec["publish"], f"{at}: publish")
        self._same(self.made and not self.made_seen, rec["update"], f"{at}: the update made")
        self.published_seen, self.made_seen = self.published, self.made
        reports = self.recorded[0]["reports"] if self.recorded and "reports" in self.recorded[0] else None
        if reports is None:
            return True
        trained = set()
        for slot, report in zip(self.slots, reports):
            finished = report["responses"] + report["verdicts"]
            beyond = sorted(set(finished) - set(slot.running))
            if beyond:  # the loop's rank ran samples the simulator gave it none of: nothing more compares
                self.differences.append(f"{self.where}: {at}: rank {slot.index} finished {beyond}, which the "
                                        f"simulator did not give it")
                raise Diverged
            slot.running = [i for i in slot.running if i not in set(finished)]
            slot.finished = finished
            if slot.role == Role.ROLLOUT:  # what the simulator's engines would have generated
                self.step.gen[finished] = self.step.length[finished]
            else:
                self.step.cgen[finished] = self.step.critique[finished]
            self._same(len(slot.running), report["in_flight"], f"{at}: in flight on rank {slot.index}")
            trained |= set(report["trained"])
        handed = {group for group, _, _ in self.train_groups}
        self._same(sorted(trained - handed), [], f"{at}: groups trained beyond those handed")
        kept = [g for g in self.train_groups if g[0] in trained]
        if self.train_groups:
            self.update.train([g for g, _, _ in kept])
        self.train_groups, self.train_left = [], 0.0
        return True

    def _carry(self, step) -> list[int]:
        self.exported_at_end = super()._carry(step)
        return self.exported_at_end


def replay(measured: dict, steps: list[dict], placement: str, max_staleness: int,
           split: str | None = None, updates: str = "step") -> list[str]:
    """A recorded run (`steps`: rounds.jsonl's lines) of `placement` at --max-staleness `max_staleness` and
    --updates `updates` (disaggregated at --split `split`), on the ranks its rounds report from, replayed on
    the cost model of `measured` (bench/placements.py's JSON: shifts and publishes take the time they took
    there, which moves no order): its differences."""
    ranks = len(steps[0]["rounds"][0]["reports"])
    line = next((line for line in steps if line["samples"]), steps[0])
    workload = replace(cpu_workload(measured), prompts=line["samples"] // line["group_size"],
                       group_size=line["group_size"])
    fixed = None
    if placement == "disaggregated":
        roles = planner.parse_split(split, ranks)
        fixed = {role: roles.count(role) for role in ROLES}
    return Replay(CpuModel(load(), measured), workload, ranks, placement, max_staleness, fixed,
                  updates).replay(steps)


def replay_bench(measured: dict) -> dict[str, list[str]]:
    """Every run whose rounds bench/placements.py kept (`measured["rounds"]`, by placement@K), replayed:
    the differences of each. A bench that names no --updates ran the loop before it had one: step-locked."""
    out = {}
    for name, steps in measured["rounds"].items():
        placement, k = name.split("@")
        out[name] = replay(measured, steps, placement, int(k), measured["split"], measured.get("updates", "step"))
    return out


def replay_run(run: Path, measured: dict) -> list[str]:
    """A run of pivot_train.py --trace-rounds in `run`, replayed as its config.json launched it (step-locked
    where it names no --updates: the loop had none then)."""
    config = json.loads((run / "config.json").read_text())
    if config["filter_groups"] or config["on_parse_failure"] == "retry":
        raise SystemExit(f"{run} ran with --filter-groups or --on-parse-failure retry, whose admissions and retries "
                         f"the simulator does not model: replay a run without them")
    steps = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]
    return replay(measured, steps, config["placement"], config["max_staleness"], config["split"],
                  config.get("updates", "step"))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("bench_json", help="bench/placements.py --json's output: its runs' rounds and cost model")
    p.add_argument("--run", default=None, help="a pivot_train.py --trace-rounds run's --out, replayed on "
                                               "bench_json's cost model instead")
    args = p.parse_args()
    measured = json.loads(Path(args.bench_json).read_text())
    if args.run is not None:
        if not (Path(args.run) / "rounds.jsonl").exists():
            sys.exit(f"--run {args.run} holds no rounds.jsonl: run pivot_train.py with --trace-rounds")
        runs = {args.run: replay_run(Path(args.run), measured)}
    elif not measured.get("rounds"):
        sys.exit(f"{args.bench_json} keeps no rounds: run bench/placements.py again, which records them")
    else:
        runs = replay_bench(measured)
    for name, found in runs.items():
        print(f"{name}: " + (f"{len(found)} differences" if found else "the simulator orders what the loop ordered"))
        for line in found[:10]:
            print(f"  {line}")
    sys.exit(1 if any(runs.values()) else 0)


if __name__ == "__main__":
    main()
