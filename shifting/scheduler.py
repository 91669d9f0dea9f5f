"""Shift-aware scheduler: one step's work queues, kept on rank 0, and the tick loop every rank runs.

A step's work is one rollout request per sample (P x G) and, as each response finishes, one judge
request for it. Every rank runs the same loop of ticks: it steps the engine of the role it holds
once, then all ranks report to rank 0 (requests finished, requests exported by a shift, requests in
flight) and rank 0 answers each with its orders: the role to hold next and new requests for it. A
rank told to change role first exports its in-flight requests; they go back to the head of their
queue and resume on another rank with prompt + generated as the prompt and their sampler's state,
so a migrated sequence comes out token for token as it would have without the move.

Ticks are lockstep collectives, so what is dispatched where and when depends on the seed and the
plan, never on timing. Invariant (tested): every prompt yields exactly G responses, each judged
exactly once, with no generated token lost or repeated.
"""
import random
import time
from collections import deque
from dataclasses import dataclass, field

import torch.distributed as dist

import faults
from roles.engine import Completion, Request
from roles.genrm import GenRM
from roles.rollout import RolloutEngine, Sample, request_key

ROLES = ("rollout", "genrm", "train")


@dataclass
class Report:
    role: str
    in_flight: int = 0
    finished: list[tuple[Request, Completion]] = field(default_factory=list)
    exported: list[Request] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)  # tokens so far of each request in flight
    in_flight_tokens: int = 0  # their prompt + generated tokens
    step_seconds: float = 0.0  # the rank's last engine step, and its batch
    step_batch: int = 0
    step_prefill: int = 0  # prompt (+ resumed) tokens of the requests that step took in


@dataclass
class Orders:
    roles: list[str]  # every rank's role from now on (the same on every rank)
    work: list[Request] = field(default_factory=list)  # new requests for this rank
    done: bool = False
    error: str | None = None


class StepQueues:
    """Rank 0's view of one step: queued requests per role, samples, and which are judged."""

    def __init__(self, batch: list[dict], rollout: RolloutEngine, genrm: GenRM, *, step: int, args):
        self.batch, self.rollout, self.genrm, self.step = batch, rollout, genrm, step
        self.queue = {"rollout": deque(RolloutEngine.requests(
            batch, group_size=args.group_size, step=step, seed=args.seed, temperature=args.temperature,
            max_tokens=args.max_response_tokens)), "genrm": deque()}
        self.expected = len(self.queue["rollout"])
        self.samples: dict[tuple[int, int], Sample] = {}
        self.judged: set[tuple[int, int]] = set()
        self.in_flight = {"rollout": 0, "genrm": 0}
        self.parse_failures = 0
        self.judge_runs = 0  # judge requests completed, retries excluded
        self.migrated = 0  # sequences exported by a shift and queued again
        self.reports: list[Report] = []  # the last tick's, in rank order
        # Engine steps per role, keyed (ranks that stepped an engine in the same tick, batch, prefill or
        # not) -> [steps, seconds, prefill tokens]: what a cost model of the engines is fitted on.
        self.engine_steps = {"rollout": {}, "genrm": {}}
        self.ticks, self.ticks_engine_s = 0, 0.0  # lockstep ticks, and the slowest engine step of each summed
        self.plan_s = 0.0  # rank 0's seconds in the plan function, which every rank waits for
        self.shift_s = 0.0  # seconds of the shifts made while rolling out and judging

    def ingest(self, reports: list[Report]) -> None:
        self.reports = reports
        stepped = [r for r in reports if r.step_batch]
        if stepped:
            self.ticks += 1
            self.ticks_engine_s += max(r.step_seconds for r in stepped)
        for r in stepped:
            key = (len(stepped), r.step_batch, r.step_prefill > 0)
            row = self.engine_steps[r.role].setdefault(key, [0, 0.0, 0])
            row[0], row[1], row[2] = row[0] + 1, row[1] + r.step_seconds, row[2] + r.step_prefill
        for report in reports:
            self.migrated += len(report.exported)
            for request in report.exported:
                # Migrated work goes first: it holds the oldest sequences of the step.
                self.queue["rollout" if request.id.startswith("r/") else "genrm"].appendleft(request)
            for request, done in report.finished:
                key = request_key(request.id)
                if request.id.startswith("r/"):
                    assert key not in self.samples, f"sample {key} generated twice"
                    sample = self.rollout.to_sample(request, done, self.batch[key[0]])
                    self.samples[key] = sample
                    self.queue["genrm"].append(self.genrm.request(sample, self.step))
                else:
                    assert key not in self.judged, f"sample {key} judged twice"
                    sample = self.samples[key]
                    if not request.id.endswith("/retry"):
                        sample.prefill_tokens += done.prefill_tokens
                        self.judge_runs += 1
                    if self.genrm.score(sample, request, done):
                        self.judged.add(key)
                    else:
                        self.queue["genrm"].append(self.genrm.request(sample, self.step, retry=True))
                    self.parse_failures += sample.parse_failed and not request.id.endswith("/retry")
        self.in_flight = {role: sum(r.in_flight for r in reports if r.role == role) for role in ("rollout", "genrm")}

    def pending(self, role: str) -> bool:
        """Work this role still has to do in the step, queued, in flight or (judging) yet to come."""
        if role == "rollout":
            return bool(self.queue["rollout"]) or self.in_flight["rollout"] > 0
        if role == "genrm":
            return len(self.judged) < self.expected
        return False

    def done(self) -> bool:
        return len(self.judged) == self.expected

    def dispatch(self, roles: list[str], capacity: int, in_flight: list[int]) -> list[list[Request]]:
        """Shares each role's queue among the ranks holding it, up to each engine's capacity."""
        work = [[] for _ in roles]
        for role in ("rollout", "genrm"):
            ranks = [r for r, held in enumerate(roles) if held == role]
            for i, rank in enumerate(ranks):
                fair = -(-len(self.queue[role]) // (len(ranks) - i))
                for _ in range(min(fair, capacity - in_flight[rank])):
                    work[rank].append(self.queue[role].popleft())
        return work

    def ordered_samples(self) -> list[Sample]:
        return [self.samples[key] for key in sorted(self.samples)]

    def engine_metrics(self) -> dict:
        """The step's engine steps for metrics.jsonl: per role, rows [busy ranks, batch, steps, seconds,
        prefill tokens], decode-only steps (prefill 0) apart from those that also prefilled."""
        rows = {role: [[busy, batch, n, round(s, 6), tokens] for (busy, batch, _), (n, s, tokens)
                       in sorted(table.items())] for role, table in self.engine_steps.items()}
        return {"engine_steps": rows, "ticks": self.ticks, "ticks_engine_s": self.ticks_engine_s,
                "plan_s": self.plan_s, "rollout_judge_shift_s": self.shift_s}


def colocated_plan(roles: list[str], queues: StepQueues, rng: random.Random) -> list[str]:
    """Every rank rolls out, then every rank judges, once no rollout is left anywhere."""
    if queues.pending("rollout"):
        return ["rollout"] * len(roles)
    return ["genrm"] * len(roles)


def forced_plan(roles: list[str], queues: StepQueues, rng: random.Random, rate: float) -> list[str]:
    """--force-shifts: with probability `rate` a random rank moves to a random other role; then any
    role left with queued work and no rank takes one, so the step always finishes."""
    roles = list(roles)
    if rng.random() < rate:
        rank = rng.randrange(len(roles))
        roles[rank] = rng.choice([r for r in ROLES if r != roles[rank]])
    for role in ("rollout", "genrm"):
        if queues.queue[role] and role not in roles:
            # The rank whose role has least left to do gives way.
            spare = [r for r, held in enumerate(roles) if held == "train" or not queues.pending(held)]
            roles[rng.choice(spare) if spare else rng.randrange(len(roles))] = role
    return roles


def generate(d, context, queues: StepQueues | None, plan, *, capacity: int, seed: int, step: int,
             timeline, progress=None) -> tuple[list[Sample], list[dict], float]:
    """Runs one step's rollout and judging on every rank; rank 0 passes its queues, the others None.
    `context` (shifting.context.RoleContext) holds this rank's role and engines and carries out every
    shift. Returns the step's samples in (prompt, sample) order on every rank, the shifts (the same
    list on every rank), and the seconds this rank spent prefilling migrated sequences again."""
    rng = random.Random(f"{seed}/{step}")
    report, shifts = Report(role=context.role), []
    plain_ticks, resumed_ticks = [], []  # engine-step seconds, without and with resumed prefills
    while True:
        orders = _exchange(d, report, queues, plan, list(context.roles), rng, capacity)
        if progress is not None and queues is not None:
            progress.update(len(queues.judged) - progress.n)
        if orders.error:
            raise SystemExit(orders.error)
        if orders.done:
            break
        exported = []
        if orders.roles != context.roles:
            engine = context.engines.get(context.role)
            if orders.roles[d.rank] != context.role and engine is not None:
                exported = engine.export()
            start = time.perf_counter()
            shifts += timeline.apply(step, context, orders.roles)
            if queues is not None:  # collective: every rank waits for the slowest shift
                queues.shift_s += time.perf_counter() - start
        engine = context.engines.get(context.role)
        if engine is not None and orders.work:
            engine.add(orders.work)
        finished, seconds, batch = [], 0.0, 0
        prefill = sum(len(r.prompt_ids) + len(r.generated) for r in orders.work)
        if engine is not None and engine.in_flight():
            start, batch = time.perf_counter(), engine.in_flight()
            with timeline.busy(step, context.role):
                finished = engine.step()
            faults.point(context.role, d.rank)
            seconds = time.perf_counter() - start
            resumed = any(r.generated for r in orders.work)
            (resumed_ticks if resumed else plain_ticks).append(seconds)
        report = Report(context.role, finished=finished, exported=exported, step_seconds=seconds, step_batch=batch,
                        step_prefill=prefill if batch else 0)
        if engine is not None:
            report.in_flight, report.generated = engine.in_flight(), engine.generated()
            report.in_flight_tokens = engine.in_flight_tokens()
    samples = [None]
    if d.rank == 0:
        samples = [queues.ordered_samples()]
    dist.broadcast_object_list(samples, src=0, group=d.control)
    return samples[0], shifts, _extra_seconds(resumed_ticks, plain_ticks)


def _extra_seconds(resumed_ticks: list[float], plain_ticks: list[float]) -> float:
    """What resuming migrated sequences cost this rank: the time of the engine steps that prefilled
    them beyond a typical step without such prefills."""
    if not resumed_ticks or not plain_ticks:
        return 0.0
    typical = sorted(plain_ticks)[len(plain_ticks) // 2]
    return sum(max(0.0, t - typical) for t in resumed_ticks)


def _exchange(d, report: Report, queues: StepQueues | None, plan, roles: list[str], rng, capacity) -> Orders:
    """All ranks' reports to rank 0; its orders back to each rank."""
    reports = [None] * d.world_size if d.rank == 0 else None
    dist.gather_object(report, reports, dst=0, group=d.control)
    orders = [None] * d.world_size
    if d.rank == 0:
        orders = _decide(reports, queues, plan, roles, rng, capacity)
    mine = [None]
    dist.scatter_object_list(mine, orders if d.rank == 0 else None, src=0, group=d.control)
    return mine[0]


def _decide(reports, queues: StepQueues, plan, roles: list[str], rng, capacity) -> list[Orders]:
    try:
        queues.ingest(reports)
    except Exception as e:  # a judge output under --on-parse-failure stop, or a broken invariant
        return [Orders(roles, error=f"step {queues.step}: {e}") for _ in roles]
    if queues.done():
        return [Orders(roles, done=True) for _ in roles]
    start = time.perf_counter()
    new = plan(roles, queues, rng)
    queues.plan_s += time.perf_counter() - start
    # A rank that changes role exports its in-flight requests this tick and takes new work next tick.
    in_flight = [rep.in_flight if rep.role == new[r] else capacity for r, rep in enumerate(reports)]
    work = queues.dispatch(new, capacity, in_flight)
    return [Orders(new, work=work[r]) for r in range(len(new))]
