"""Shift-aware scheduler: one step's work queues, kept on rank 0, and the loop every rank runs.

A step's work is one rollout request per sample (P x G) and, as each response finishes, one judge
request for it. Ranks work in rounds. At the start of a round rank 0 hands every rank its orders:
every rank's role from now on, new requests for its engine, and how long to work before reporting
back. Each rank then makes its shift, if it has one (a shift between the engine roles is its own; a
change of the train group is collective), and steps the engine of its role, or trains (with the
other train ranks) the judged groups no train rank has had, group by group, on its own and at its
own pace, until its round ends (groups it did not reach are handed out again); then all ranks report
to rank 0 (requests finished, turned into samples and verdicts where they finished; requests in
flight; the engine steps they took; their shift) and rank 0 decides the next
round. A rank told to change role first exports its in-flight requests; they go back to the head of
their queue and resume on another rank with prompt + generated as the prompt and their sampler's
state, so a migrated sequence comes out token for token as it would have without the move. They go on in
the same round: its orders come with their work held back (`Orders.migrate`), the leaving ranks export to
rank 0 before anything else, and rank 0 hands the round's work out with them at the head of their queues.
With --engine-tp T rank 0 decides all this for slots of T ranks (one engine each; `_exchange`): every rank
of a slot gets the slot's orders, and rank 0 reads its first rank's report.

How long a round lasts is the placement's to say (`Rounds`): a placement that cannot change anything
before every engine has run empty (colocated, with nothing queued) works until then and reports once;
a planner that may move ranks at any time reports every `round_steps` engine steps' worth of time (and
at least ROUND_OVER_EXCHANGE exchanges' and ROUND_OVER_LONGEST of the longest recent steps' worth:
shifting/book.py, whose rules the simulator follows too), so
the exchange with rank 0, and the wait at a round's end for the steps in progress, cost a small part
of the engines' time however fast their steps are (a GPU decode step or a CPU one) and however many
ranks report; a rank past its time keeps working until every rank is past its own, and once an eighth
of the ranks (one at least) have run empty the round ends for all (`RoundEnd`, through the launch's
store, no collective);
`--force-shifts` reports after every engine step, so its seeded schedule of moves is the same from
run to run. What each sample is does not depend on any of this: every request
carries its own seed and migrates with its sampler's state. Invariant (tested): every prompt yields
exactly G responses, each judged exactly once, with no generated token lost or repeated.

With --max-staleness K > 0 the groups the train ranks work through are not this step's but those of
the step K earlier (`train_pool`: generated and judged already, all ready at the step's start), so
training overlaps rollout and judging; without K they are this step's, as each is judged. Once the train
ranks have trained every group of the pool they make the update at the next round's start, and every
rank publishes it right after (the others wait for its optimizer step): each rollout rank exports its
sequences in flight, loads the new weights and adds them back (a migration to itself: they go on under
the new version, re-prefilled), and the next step's prompts join the queue (`StepQueues.publish`), where
a next step may begin (pivot_train.py passes its prompts). When to make, when to publish, and which step
begins are rules of shifting/book.py (update_due, publish_due, ahead_step), which the simulator follows
too. The step ends with its own last critique; the next step's work begun by then is carried into it
(`carry`). Each request keeps the versions that sampled its tokens (`Request.versions`).

With --filter-groups (DAPO's dynamic sampling, arXiv:2503.14476, section 3.2) the step's `prompts` hold
every prompt it may draw. The first --prompts-per-step are queued; each group judged whose rewards are all
equal is left out of the update, and the next of its `prompts` takes its place: its G requests join the
rollout queue then, while the step runs. Every prompt admitted adds one informative group or one more
admission, so what a step draws does not depend on the order its groups finish in: the shortest prefix of
`prompts` that hold --prompts-per-step informative groups, or all of it. A group handed to the train ranks
is judged and informative, so none is trained and then left out.
"""
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import faults
from algorithm import Algorithm, group_advantages, informative
from planner import TrainSpeed
from roles import ENGINE_ROLES, ROLES, WAIT, Role
from roles.engine import Completion, Request
from roles.judge import Judge, ParseFailure, Verdict
from roles.rollout import RolloutEngine, Sample
from roles.trainer import NO_EARLY, add_early
from shifting import book
from tasks import longtail


@dataclass(frozen=True)
class SamplingOptions:
    """How a step's responses are sampled, from pivot_train.py's flags (checked there, in `check_config`)."""
    group_size: int  # --group-size G: responses per prompt
    seed: int  # --seed: what each response's sampling seed (and a longtail response's length) is drawn from
    temperature: float  # --temperature: the policy samples at it
    max_response_tokens: int  # --max-response-tokens: the most tokens a response takes
    workload: str  # --workload: task (as the policy writes) or longtail (each response to a drawn length)


@dataclass(frozen=True)
class Room:
    """The intake `generate` takes where no placement decides one (the scheduler's tests): every engine
    takes in up to `seqs` sequences, with no prefill budget. A Placement is the other intake."""
    seqs: int

    def capacity(self, role: str, seqs: int, seconds: float | None) -> int:
        return self.seqs

    def budget(self, role: str, seconds: float | None, rollout_running: Callable[[], list[list[int]]]) -> None:
        return None


@dataclass(frozen=True)
class Rounds:
    """How long every rank works before its next report: at most `engine_steps` engine steps and at most
    `seconds` (None: no limit of that kind); a rank whose engine runs empty reports at once, and with
    `early` it ends the round for every rank (the placement has other work for a rank that runs empty), as
    a train rank through the groups handed to it does."""
    engine_steps: int | None = None
    seconds: float | None = None
    early: bool = False


class RoundEnd:
    """When a timed round ends, agreed without a collective: a counter in the launch's store that every
    rank adds 1 to once it has had its round's time (or has nothing left to do), and that a rank whose
    engine ran empty or that trained every group handed to it (when the placement may have other work for
    it) also adds world size + 1 to: the round ends once every rank has arrived, or once EMPTY_SHARE of the
    ranks have run empty. The rank whose add ends it sets the round's `over` key. A rank past its time
    keeps working until then: a thread of its own waits for that key on `watch` (a second client of the
    store: one client serves one request at a time, so a wait on `store` would hold the rank's other
    requests behind it), and between engine steps the rank reads the thread's flag. So no rank idles while
    another finishes a long step, a long prefill or a training share, the exchange comes once all are ready
    for it, and the store hears from each rank once or twice a round, where a look-up between engine steps
    cost every rank up to a hundred round trips a second (docs/placements.md)."""

    def __init__(self, store, watch, world_size: int, step: int):
        self.store, self.watch, self.world_size, self.step = store, watch, world_size, step
        self.empty = world_size + 1  # what a rank run empty adds: arrivals alone never reach it
        self.enough = book.empty_enough(world_size)
        self.round = -1
        self.next()

    def next(self) -> None:
        self.round, self.arrived, self.ended, self.watcher = self.round + 1, False, threading.Event(), None

    @property
    def key(self) -> str:
        return f"round-end/{self.step}/{self.round}"

    @property
    def over_key(self) -> str:
        return f"{self.key}/over"

    def arrive(self) -> None:
        """This rank has had its round's time."""
        if not self.arrived:
            self.arrived = True
            self._add(1)

    def end_now(self) -> None:
        """This rank is free and the placement may have other work for it: with enough such ranks, every rank
        stops."""
        self._add(self.empty + (0 if self.arrived else 1))
        self.arrived = True

    def _add(self, n: int) -> None:
        count = self.store.add(self.key, n)
        if not self.ended.is_set() and (count % self.empty >= self.world_size or count // self.empty >= self.enough):
            self.store.set(self.over_key, "1")
            self.ended.set()

    def stop(self, limit: Rounds, start: float) -> bool:
        """Between two pieces of a rank's work in a timed round (engine steps, train groups): arrives once
        its time is up, and says whether to stop: once it has arrived, or at once in a round that ranks
        run empty end early, when the round is over."""
        if limit.seconds is None:
            return False
        if time.perf_counter() - start >= limit.seconds:
            self.arrive()
        return (self.arrived or limit.early) and self.over()

    def over(self) -> bool:
        """Whether every rank has arrived or enough ended the round: this rank's flag, set by its own add
        that ended the round or by its thread waiting for the `over` key (started at the first question)."""
        if self.watcher is None and not self.ended.is_set():
            self.watcher = threading.Thread(target=self._wait, args=(self.over_key, self.ended), daemon=True)
            self.watcher.start()
        return self.ended.is_set()

    def _wait(self, key: str, ended: threading.Event) -> None:
        self.watch.wait([key])
        ended.set()

    def leave(self) -> None:
        """Before the round's exchange, which every rank reaches having arrived: the round is then over or
        about to be, and this rank's thread is through, so none is left waiting on a key rank 0 deletes."""
        if self.watcher is not None:
            self.watcher.join()

    def forget(self) -> None:
        """Rank 0, once every rank has left the round: its keys are no longer read."""
        self.store.delete_key(self.key)
        self.store.delete_key(self.over_key)


@dataclass
class Report:
    role: str
    responses: list[tuple[Sample, Request]] = field(default_factory=list)  # finished, with its judge request
    verdicts: list[Verdict] = field(default_factory=list)  # critiques finished, read
    generated: list[int] = field(default_factory=list)  # tokens so far of each request in flight
    in_flight_tokens: int = 0  # their prompt + generated tokens
    # The round's engine steps: (sequences in the step, seconds, prompt and resumed tokens it took in).
    engine_steps: list[tuple[int, float, int]] = field(default_factory=list)
    # Early training: the train group's sums over the groups it trained on this round (add_early's
    # keys, and `groups`: their prompt indices), and the seconds it took.
    trained: dict | None = None
    train_s: float = 0.0
    update: dict | None = None  # the update's statistics, once the train ranks made it in this round
    reloaded: int = 0  # sequences this rank's engine went on with under weights published at the round's start
    shifts: list[dict] = field(default_factory=list)  # this rank's shift at the round's start, if it made one
    shift_s: float = 0.0  # its seconds (with any collective part: a train group that changed)
    error: str | None = None  # a critique under --on-parse-failure stop

    @property
    def in_flight(self) -> int:
        return len(self.generated)

    @property
    def work_s(self) -> float:
        """Seconds this rank worked in the round: its shift, then engine steps or early training."""
        return self.shift_s + sum(seconds for _, seconds, _ in self.engine_steps) + self.train_s


@dataclass
class Orders:
    roles: list[str]  # every rank's role from now on (the same on every rank)
    work: list[Request] = field(default_factory=list)  # new requests for this rank
    train: list[list[Sample]] = field(default_factory=list)  # judged groups to train on (every train rank the same)
    update: dict | None = None  # the train ranks, before any moves: make the update over these early sums
    publish: int | None = None  # every rank, first: the train ranks publish their update as this version
    # Every rank, before anything else: ranks leaving an engine role with requests in flight export them to
    # rank 0, which hands them out with the round's work (`_migrate`): they go on in this round, not the next.
    migrate: bool = False
    rounds: Rounds = Rounds()
    done: bool = False
    carry: bool = False  # with `done`: every rank exports its engine's requests, the next step's, to rank 0
    error: str | None = None


class StepQueues:
    """Rank 0's view of one step: its scheduling book (book.Book, which the simulator keeps too: phases,
    queues, groups, hand-outs, by sample number), the request behind each number queued or in flight, and
    the samples. The ranks that finish requests turn them into samples and verdicts (tokenizers run there,
    side by side)."""

    def __init__(self, prompts: list[dict], *, step: int, sampling: SamplingOptions, algo: Algorithm,
                 round_steps: int = 1, ranks: int = 1, early_train: bool = False, train_speed: TrainSpeed | None = None,
                 train_pool: list[Sample] | None = None, skipped_in_row: int = 0, filter_groups: int | None = None,
                 version: int = 0, ahead: list[dict] | None = None, carried: "StepQueues | None" = None,
                 spill: bool = False, trace: bool = False):
        """`algo`: the run's algorithm, which gives a group judged its advantages (early training).
        `filter_groups` (--filter-groups): the informative groups the step wants (--prompts-per-step);
        `prompts` are then every prompt it may draw, admitted as groups are left out. None: all of `prompts`.
        `version`: the weights' version published as the step starts. `ahead` (with a train pool): the next
        step's prompts, admitted once the update is published during this step (`publish_due`); `carried`:
        this step's own work begun so, during the step before (`carry`). `spill` (--updates ready at K >= 2):
        the step may end with some of its groups still out, which go on in the next (book.Book.may_end,
        book.Book.spill). `ranks`: the world size, whose
        recent engine steps set a round's length (book.RecentSteps). `trace` (--trace-rounds): keep every
        round's reports and orders (`trace_round`)."""
        self.sampling, self.prompts, self.step, self.group_size = sampling, prompts, step, sampling.group_size
        self.algo = algo
        requests = RolloutEngine.requests(
            prompts, group_size=sampling.group_size, step=step, seed=sampling.seed, temperature=sampling.temperature,
            max_tokens=sampling.max_response_tokens, lengths=longtail.lengths(
                sampling.workload, sampling.seed, longtail.RESPONSE, sampling.max_response_tokens))
        admitted = len(prompts) if filter_groups is None else min(filter_groups, len(prompts))
        self.ranks = ranks
        self.book = book.Book(len(requests), self.group_size, ranks=ranks, admitted=admitted * self.group_size)
        self.requests = dict(enumerate(requests))  # by sample number: the request queued or in flight for it
        # Every sample's number in the book, by (step, prompt, sample): this step's, and those of the next
        # step and of the groups spilled into it once it begins (`publish`, `carry`)
        self.numbers = {(step, *r.key): i for i, r in enumerate(requests)}
        self.filter_groups = filter_groups is not None
        self.samples: dict[tuple[int, int, int], Sample] = {}  # by Sample.id: the step's own, as they finish
        self.in_flight = dict.fromkeys(ENGINE_ROLES, 0)
        self.parse_failures = 0
        self.judge_runs = 0  # judge requests completed, retries excluded
        self.migrated = 0  # sequences exported by a shift and queued again
        self.reports: list[Report] = []  # the last round's, in rank order
        # Engine steps per role, keyed (ranks that worked in the same round: stepped an engine or trained,
        # batch, prefill or not) -> [steps, seconds, prefill tokens]: what a cost model of the engines is
        # fitted on (on shared cores, a training rank slows the engines beside it as another engine does).
        self.engine_steps = {role: {} for role in ENGINE_ROLES}
        self.round_steps = round_steps
        self.rounds, self.rounds_work_s = 0, 0.0  # rounds, and the busiest rank's work seconds in each summed
        self.round_s = 0.0  # the last round's seconds, as rank 0 saw them
        self.next_roles_s = 0.0  # rank 0's seconds in next_roles (the metrics' plan_s), which every rank waits for
        self.shifts: list[dict] = []  # made while rolling out and judging, round by round in rank order
        self.shift_s = 0.0  # their seconds: the longest of each round, summed
        # Early training: the judged groups the train ranks have trained on (prompt indices), what they
        # summed, and the training speed their rounds measure (the run's estimate, Placement.train_speed).
        self.early_train = early_train
        self.train_speed = TrainSpeed() if train_speed is None else train_speed
        # The scored samples of an earlier step that this step's update trains on (--max-staleness > 0),
        # by key; None: this step's own.
        self.train_pool = None if train_pool is None else {s.id: s for s in train_pool}
        # The book the update's groups are handed out from: this step's, or the train pool's, whose groups
        # (of one step, or with --updates ready those spilled from the step before it first) it numbers in
        # (step, prompt) order, as the step's book that judged them numbered them as it ended. Its groups by
        # number, and their numbers.
        self.update_groups = [(step, p) for p in range(len(prompts))] if train_pool is None else \
            sorted({s.group for s in train_pool})
        self.group_numbers = {group: number for number, group in enumerate(self.update_groups)}
        self.update_book = self.book if train_pool is None else book.Book.judged_pool(
            {number * self.group_size + s.sample_index: len(s.prompt_ids) + len(s.response_ids)
             for number, group in enumerate(self.update_groups)
             for s in (self.train_pool[(*group, g)] for g in range(self.group_size))}, self.group_size)
        self.trained: list[tuple[int, int]] = []  # the groups the train ranks trained, as (step, prompt)
        self.early = dict(NO_EARLY)
        self.early_train_s = 0.0
        # With a train pool the update need not wait for the step's end: once its last group is trained the
        # train ranks make it (`update_due`), and its statistics land here. `skipped_in_row`: optimizer
        # steps skipped in a row before it, which the trainer continues.
        self.update: dict | None = None
        self.skipped_in_row = skipped_in_row
        # The partial rollout: the update is published at the round's start at which it is made; the
        # rollout engines load it there and go on with their sequences under it (re-prefilled), and the
        # next step's prompts join the queue (sampled by the new weights, they are --max-staleness old at
        # their own update). What of that step is not done when this one is goes on in the next.
        self.version, self.ahead_prompts, self.published = version, ahead, False
        self.ahead: StepQueues | None = None
        self.reloaded = 0  # sequences that went on under the weights published during the step
        # --updates ready: the step may end with groups out (`done`); the seconds its rounds went on only
        # for groups carried in from the step before (at the bound), and the seconds no rollout was queued
        # or in flight while they went on
        self.spill, self.spilled = spill, 0
        self.bound_wait_s = self.rollout_idle_s = 0.0
        self.waiting = (False, False)  # whether the round under way waits for the bound, and has no rollout
        self.trace: list[dict] | None = [] if trace else None
        self.deferred: tuple | None = None  # a round's orders until its migration (`migrate`)
        self.capacity: dict[str, int] = {}  # the last dispatch's: the most sequences an engine of each role took in
        self.budget: dict[str, float | None] = {}  # ... and the context tokens it took in at most (None: no limit)
        self.begun = time.perf_counter()  # the trace's rounds are timed from here
        if carried is not None:
            self._take_over(carried)

    def _take_over(self, carried: "StepQueues") -> None:
        """This step's work that the step before began (its `ahead`): its book, samples and counts, and its
        requests not finished, queued or exported from the engines as that step ended."""
        assert carried.step == self.step and carried.prompts == self.prompts, "the carried step is not this one"
        self.book, self.requests, self.samples = carried.book, carried.requests, carried.samples
        self.numbers = carried.numbers
        if self.train_pool is None:
            self.update_book = self.book
        self.judge_runs, self.parse_failures, self.migrated = carried.judge_runs, carried.parse_failures, carried.migrated

    def number(self, request: Request | Verdict) -> int:
        """A request's or a verdict's sample number in the book and the trace: prompt x G + sample within its
        step, the groups spilled from the step before first and the next step's after this step's own, as
        the simulator numbers its samples (sim/engine.py Step, book.Book.spill)."""
        return self.numbers[(request.step, *request.key)]

    def group_number(self, group: tuple[int, int]) -> int:
        """A group's number in the update's book: in the train pool's order, or this step's prompt's."""
        return self.group_numbers[group]

    def queued(self, role: str) -> list[Request]:
        """The requests in the role's queue, from its head."""
        return [self.requests[i] for i in self.book.queue[role]]

    def _of(self, i: int) -> "StepQueues":
        """The queues that keep sample i: this step's, or the next step's, begun during it."""
        if i < self.book.n:
            return self
        assert self.ahead is not None, f"sample {i} is beyond step {self.step}'s"
        return self.ahead

    def publish_due(self, making: bool) -> bool:
        """Whether to publish the update now, during the step (book.publish_due): it is made, or `making`
        (rank 0 orders the train ranks to make it at this round's start, first), not published yet, and the
        step may run ahead (`ahead_prompts`)."""
        return book.publish_due(self.update is not None or making, self.published, self.ahead_prompts is not None)

    def publish(self) -> int:
        """The update goes out at this round's start: the version published, and the next step's prompts
        (their requests behind this step's) join the queue (book.Book.extend)."""
        self.published = True
        self.ahead = StepQueues(self.ahead_prompts, step=self.step + 1, sampling=self.sampling,
                                algo=self.algo, version=self.version + 1, ranks=self.ranks)
        n = self.book.n
        self.book.extend(self.ahead.book)
        self.requests.update((i + n, request) for i, request in self.ahead.requests.items())
        self.numbers.update((key, i + n) for key, i in self.ahead.numbers.items())
        return self.version + 1

    def carry(self, exported: list[Request]) -> "StepQueues | None":
        """As the step ends: the next step's queues, holding what of it is done and, queued first, the
        requests the engines exported (every request left belongs to it). Where the step ends with groups
        still out (`done`, --updates ready), they go on in the next step, first in its book, requests and
        samples (book.Book.spill)."""
        if self.ahead is None:
            return None
        if not self.book.done():
            number = self.book.spill()
            self.requests = {int(number[i]): r for i, r in self.requests.items()}
            self.numbers = {key: int(number[i]) for key, i in self.numbers.items()}
            self.spilled = self.ahead.book.carried_in
        numbers, n = [self.number(r) for r in exported], self.book.n
        self.requests.update(zip(numbers, exported))
        self.ahead.book = self.book.carry(numbers)
        self.ahead.requests = {i - n: r for i, r in self.requests.items() if i >= n}
        self.ahead.numbers = {key: i - n for key, i in self.numbers.items() if i >= n}
        for key in [key for key in self.samples if self.numbers[key] >= n]:
            self.ahead.samples[key] = self.samples.pop(key)
        self.ahead.migrated += len(exported)
        if self.trace is not None:
            self.trace.append({"carry": numbers})
        return self.ahead

    def trace_round(self, reports: list[Report], orders: list["Orders"]) -> None:
        """--trace-rounds: what rank 0 read from every rank this round (its role, the samples it finished, how
        many it has in flight, the groups it trained, whether it made the update) and what it
        ordered (the roles, the samples each rank takes, the groups handed to train, publish, update,
        done, a timed round, and its seconds), with when rank 0 ordered it (`at`, seconds into the step) and
        samples by their numbers (`number`)."""
        ids = lambda requests: [self.number(r) for r in requests]  # noqa: E731
        train = next((o.train for o in orders if o.train), [])
        self.trace.append({
            "reports": [{"role": r.role, "responses": ids(judging for _, judging in r.responses),
                         "verdicts": ids(r.verdicts), "in_flight": r.in_flight,
                         "trained": [self.group_number(g) for g in r.trained["groups"]] if r.trained else [],
                         "update": r.update is not None}
                        for r in reports],
            "roles": orders[0].roles, "work": [ids(o.work) for o in orders],
            "handed": [self.group_number(group[0].group) for group in train], "publish": orders[0].publish is not None,
            "update": any(o.update is not None for o in orders), "timed": orders[0].rounds.seconds is not None,
            "capacity": self.capacity, "budget": self.budget,
            "seconds": orders[0].rounds.seconds, "done": orders[0].done, "at": time.perf_counter() - self.begun})

    def ingest(self, reports: list[Report], round_s: float) -> None:
        self.reports, self.round_s = reports, round_s
        self.bound_wait_s += round_s * self.waiting[0]
        self.rollout_idle_s += round_s * self.waiting[1]
        stepped = [r for r in reports if r.engine_steps]
        busy = sum(bool(r.engine_steps or r.train_s) for r in reports)
        worked = [r.work_s for r in reports if r.engine_steps or r.trained or r.shifts]
        if worked:
            self.rounds += 1
            self.rounds_work_s += max(worked)
        self.shifts += [record for r in reports for record in r.shifts]
        self.shift_s += max((r.shift_s for r in reports if r.shifts), default=0.0)
        for r in stepped:
            for batch, seconds, prefill in r.engine_steps:
                row = self.engine_steps[r.role].setdefault((busy, batch, prefill > 0), [0, 0.0, 0])
                row[0], row[1], row[2] = row[0] + 1, row[1] + seconds, row[2] + prefill
                self.book.recent_steps.add(seconds)
        for report in reports:
            for sample, judging in report.responses:
                i = self.number(judging)
                queues = self._of(i)
                assert sample.id not in queues.samples, f"sample {sample.key} of step {sample.step} generated twice"
                queues.samples[sample.id] = sample
                self.book.respond(i, len(sample.prompt_ids) + len(sample.response_ids))
                self.requests[i] = judging
            for verdict in report.verdicts:
                self._judged(verdict)
            self.reloaded += report.reloaded
        made = [r.update for r in reports if r.update]
        if made:  # every train rank reports the same statistics
            self.update = {**made[0], "train_tokens_per_s": self.train_speed.per_s}
        trainers = [r for r in reports if r.trained]
        if trainers:  # every train rank reports the group's sums: count them once
            groups = trainers[0].trained["groups"]
            self.update_book.train([self.group_number(group) for group in groups])
            self.trained += groups
            self.early = add_early(self.early, trainers[0].trained)
            seconds = max(r.train_s for r in trainers)
            self.early_train_s += seconds
            if groups and seconds > 0:  # prompt and response tokens through forward and backward, per rank
                pool = self.train_samples()
                tokens = sum(len(pool[(*group, g)].prompt_ids) + len(pool[(*group, g)].response_ids)
                             for group in groups for g in range(self.group_size))
                self.train_speed.observe(tokens / (seconds * len(trainers)))
        self.in_flight = {role: sum(r.in_flight for r in reports if r.role == role) for role in ENGINE_ROLES}
        self.waiting = (self.spill and self.book.waits_for_bound(),
                        not self.book.queue[Role.ROLLOUT] and not self.in_flight[Role.ROLLOUT])

    def requeue(self, exported: list[Request]) -> None:
        """Requests a rank's engine exported as it left its role: back to the head of their queue, in order."""
        self.migrated += len(exported)
        numbers = [self.number(r) for r in exported]
        self.requests.update(zip(numbers, exported))
        self.book.requeue(numbers)

    def migrate(self, exported: list[list[Request]], intake) -> list[list[Request]]:
        """The round's work, where ranks leaving an engine role exported requests as it began (`Orders.migrate`):
        theirs, by rank, go back to the head of their queues first, so they go on in this round on the ranks
        that hold their role. `deferred`: the round's orders, what each rank's engine runs, the round's
        seconds; the orders get their work, and are traced."""
        for requests in exported:
            self.requeue(requests)
        orders, in_flight, seconds = self.deferred
        self.deferred = None
        work = self.dispatch(orders[0].roles, intake, in_flight, seconds)
        for o, share in zip(orders, work):
            o.work = share
        _traced(self, self.reports, orders)
        return work

    def _judged(self, verdict: Verdict) -> None:
        i = self.number(verdict)
        queues = self._of(i)
        assert self.book.phase[i] == book.JUDGING, f"sample {verdict.key} of step {verdict.step} judged twice"
        verdict.apply(queues.samples[(verdict.step, *verdict.key)])
        queues.judge_runs += verdict.first_try
        queues.parse_failures += verdict.parse_failed and verdict.first_try
        if verdict.retry:
            self.book.retry(i)
            self.requests[i] = verdict.retry
            return
        del self.requests[i]
        if self.book.judge(i):
            group = [queues.samples[(verdict.step, verdict.key[0], g)] for g in range(self.group_size)]
            group_advantages(self.algo, [group])  # as the update gives them (pivot_train.update_samples)
            if queues.filter_groups and not informative([s.reward for s in group]):
                self._drop(group, i // self.group_size)

    def _drop(self, group: list[Sample], number: int) -> None:
        """--filter-groups: a group of equal rewards (`number` in the book) leaves the update, and the next
        prompt the step may draw, if any is left, is admitted in its place: its G requests are queued now
        (book.Book.drop)."""
        for s in group:
            s.dropped = True
        self.book.drop(number)

    def train_samples(self) -> dict[tuple[int, int], Sample]:
        """The samples this step's update trains on, by key: the train pool's, or this step's so far."""
        return self.samples if self.train_pool is None else self.train_pool

    def update_due(self) -> bool:
        """Whether the train ranks can make the update now: its groups are an earlier step's (a train pool),
        every one of them is trained into their gradients (book.Book.through), and it is not made yet
        (book.update_due). Its weights are published right after, at the same round's start, if the step may
        run ahead (`publish_due`), else at its end."""
        return book.update_due(self.early_train and bool(self.train_pool), self.update_book.through(),
                               self.update is not None)

    def hand_to_train(self) -> list[list[Sample]]:
        """Every judged group of the update no train rank has had, in prompt order (book.Book.ready): the
        train ranks work through them one at a time until the round ends (`_train`), and report which they
        trained; the others are handed out again."""
        pool = self.train_samples()
        return [[pool[(*self.update_groups[number], g)] for g in range(self.group_size)]
                for number in self.update_book.ready()]

    def pending(self, role: str) -> bool:
        """Work this role still has to do in the step, queued, in flight or (judging) yet to come."""
        if role == Role.ROLLOUT:
            return bool(self.book.queue[Role.ROLLOUT]) or self.in_flight[Role.ROLLOUT] > 0
        return role == Role.JUDGE and self.book.judging_left()

    def done(self) -> bool:
        """Every sample the step admitted is judged; or, where it may (`spill`), all but the groups the book
        lets go on in the next step (book.Book.may_end)."""
        return self.book.done() or self.spill and self.book.may_end()

    def timed_round(self) -> Rounds:
        """A round of `round_steps` engine steps' worth of time, at the median step seen so far, and at
        least ROUND_OVER_EXCHANGE times the last exchange (many ranks exchange slower than few) and
        ROUND_OVER_LONGEST times the longest recent step, that ranks whose engines run empty end early
        (book.Book.round_seconds)."""
        return Rounds(seconds=self.book.round_seconds(self.round_steps), early=True)

    def dispatch(self, roles: list[str], intake, in_flight: list[int],
                 seconds: float | None = None) -> list[list[Request]]:
        """Shares each role's queue among the ranks holding it, evening out their engines' loads up to
        each engine's `intake.capacity(role, seqs, seconds)` (the placement's, given the role's sequences
        queued and running, for a round of `seconds`: book.intake; book.Book.dispatch), in rank order from
        the queue's head; where `intake.budget(role, seconds, running)` gives a prefill budget for a round
        of `seconds` (book.prefill_budget; `running()`: what the rollout ranks run this round,
        `rollout_running`, read only where a budget needs it) each engine keeps of its share the context
        tokens it prefills in the round. Rollout's queue is shared first, so the judge's budget counts the
        sequences a rank leaving rollout hands over."""
        work = [[] for _ in roles]
        self.capacity, self.budget = {}, {}
        context = lambda i: len(self.requests[i].prompt_ids) + len(self.requests[i].generated)  # noqa: E731
        for role in ENGINE_ROLES:
            ranks = [r for r, held in enumerate(roles) if held == role]
            held = [in_flight[r] for r in ranks]
            self.capacity[role] = intake.capacity(role, len(self.book.queue[role]) + sum(held), seconds)
            self.budget[role] = intake.budget(role, seconds, lambda: self.rollout_running(roles, work))
            for rank, numbers in zip(ranks, self.book.dispatch(role, held, self.capacity[role], self.budget[role],
                                                               context)):
                work[rank] = [self.requests[i] for i in numbers]
        return work

    def rollout_running(self, roles: list[str], work: list[list[Request]]) -> list[list[int]]:
        """The tokens generated so far by each sequence every rollout rank runs this round: those it held
        (a rank that stays) and those handed to it in `work` (a leaving rank's, migrated, resume where they
        were), as the simulator's slots hold them (sim/engine.py `_until_empty`); none while rollout's
        queue holds work no engine took (prompts waiting for room)."""
        if self.book.queue[Role.ROLLOUT]:
            return []
        return [(list(rep.generated) if rep.role == Role.ROLLOUT else []) + [len(r.generated) for r in new]
                for rep, role, new in zip(self.reports, roles, work) if role == Role.ROLLOUT]

    def ordered_samples(self) -> list[Sample]:
        return [self.samples[key] for key in sorted(self.samples)]

    def engine_metrics(self) -> dict:
        """The step's engine steps for metrics.jsonl: per role, rows [busy ranks, batch, steps, seconds,
        prefill tokens], decode-only steps (prefill 0) apart from those that also prefilled."""
        rows = {role: [[busy, batch, n, round(s, 6), tokens] for (busy, batch, _), (n, s, tokens)
                       in sorted(table.items())] for role, table in self.engine_steps.items()}
        return {"engine_steps": rows, "rounds": self.rounds, "rounds_work_s": self.rounds_work_s,
                "plan_s": self.next_roles_s, "rollout_judge_shift_s": self.shift_s}


def colocated_roles(roles: list[str], queues: StepQueues, rng: random.Random) -> tuple[list[str], Rounds]:
    """Every rank rolls out, then every rank judges, once no rollout is left anywhere; a round is timed only
    while that role has work queued (book.Book.colocated). The prompts --filter-groups admits while the
    ranks judge wait until the judging is done: one switch back, not one a round."""
    role, timed = queues.book.colocated(roles[0], queues.in_flight)
    return [role] * len(roles), queues.timed_round() if timed else Rounds()


def forced_roles(roles: list[str], queues: StepQueues, rng: random.Random, rate: float) -> tuple[list[str], Rounds]:
    """--force-shifts: with probability `rate` a random rank moves to a random other role; then any
    role left with queued work and no rank takes one, so the step always finishes. Ranks report after
    every engine step, so the schedule depends on the seed alone."""
    roles = list(roles)
    if rng.random() < rate:
        rank = rng.randrange(len(roles))
        roles[rank] = rng.choice([r for r in ROLES if r != roles[rank]])
    for role in ENGINE_ROLES:
        if queues.book.queue[role] and role not in roles:
            # The rank whose role has least left to do gives way.
            spare = [r for r, held in enumerate(roles) if held == Role.TRAIN or not queues.pending(held)]
            roles[rng.choice(spare) if spare else rng.randrange(len(roles))] = role
    return roles, Rounds(engine_steps=1)


def generate(d, context, queues: StepQueues | None, next_roles, *, prompts: list[dict], rollout: RolloutEngine,
             judge: Judge, intake, seed: int, step: int, timeline,
             ahead: list[dict] | None = None, before: list[dict] | None = None) -> tuple[list[Sample], dict, list[dict], float]:
    """Runs one step's rollout and judging on every rank; rank 0 passes its queues, the others None.
    `context` (shifting.context.RoleContext) holds this rank's role and engines and carries out every
    shift; `next_roles(roles, queues, rng)` (Placement's) gives the roles and the next round's length;
    `intake` (the Placement, or `Room`) the most sequences an engine of a role takes in, `capacity(role,
    seqs, seconds)`, and the context tokens it takes in a round of `seconds`, `budget(role, seconds, rollout_running)`
    (`dispatch`);
    `prompts` are the step's (`ahead`, the next step's, which it may begin: StepQueues.publish; `before`, the
    step before's, whose groups that step's end left out go on in this one: StepQueues.carry) and
    `rollout`, `judge` turn finished requests into samples and verdicts; `timeline.busy(role)` marks engine and
    training work, and `timeline.busy(WAIT)` each round's exchange. Returns, on every rank, the step's samples in
    (prompt, sample) order, what early training did (`groups` trained, with their `loss_sum`,
    `clipped` and `tokens`, and the `update`'s statistics if the train ranks made it), the shifts, and
    the seconds this rank spent prefilling migrated sequences again."""
    rng = random.Random(f"{seed}/{step}")
    step_prompts = {step - 1: before or [], step: prompts, step + 1: ahead or []}
    report, since = Report(role=context.role), time.perf_counter()
    plain, resumed = [], []  # engine-step seconds, without and with resumed prefills
    ending = RoundEnd(d.store, d.watch, d.world_size, step)
    while True:
        begin = time.perf_counter()
        ending.leave()
        with timeline.busy(WAIT):
            orders = _exchange(d, report, queues, next_roles, list(context.roles), rng, intake, begin - since)
        if d.rank == 0:
            ending.forget()
            queues.book.exchange_s = time.perf_counter() - begin
        ending.next()
        since = time.perf_counter()
        if orders.error:
            raise SystemExit(orders.error)
        if orders.done:
            break
        if orders.migrate:  # this round's work comes once the requests of ranks leaving a role are back in the queues
            engine = context.engines.get(context.role)
            leaving = engine is not None and orders.roles[d.slot] != context.role
            orders.work = _migrate(d, engine.export() if leaving else [], queues, intake)
        update_s, update = 0.0, None
        if orders.update is not None:  # this rank trained the update's groups: it makes the update first
            start = time.perf_counter()
            with timeline.busy(Role.TRAIN):
                update = context.trainer.train_step([[]], orders.update, orders.update["skipped_in_row"])
            update_s = time.perf_counter() - start
        reloaded, shifted, start = [], [], time.perf_counter()
        if orders.publish is not None:
            publish_update(context, orders.publish)
        if orders.roles != context.roles or orders.publish is not None:
            # A rank leaving its role exported as the round began (`_migrate`); one staying in rollout reloads.
            staying = orders.roles[d.slot] == context.role == Role.ROLLOUT
            if staying and orders.publish is not None:
                reloaded = context.engines[Role.ROLLOUT].export()  # they go on here, under the new weights
            shifted = context.apply(orders.roles, gather=False)  # records go to rank 0 in the report
        engine = context.engines.get(context.role)
        report = Report(context.role, reloaded=len(reloaded), shifts=shifted,
                        shift_s=time.perf_counter() - start, update=update, train_s=update_s)
        through = False  # trained every group handed to it
        if orders.train:
            start = time.perf_counter()
            report.trained = _train(context.trainer, orders, timeline, ending)
            report.train_s += time.perf_counter() - start
            through = len(report.trained["groups"]) == len(orders.train)
        if engine is not None:
            engine.add(reloaded + orders.work)
            finished, report.engine_steps = _work(d, engine, orders, context.role, timeline, ending)
            _read(report, finished, step_prompts, rollout, judge)
            first = [seconds for _, seconds, _ in report.engine_steps[:1]]
            (resumed if any(r.generated for r in reloaded + orders.work) else plain).extend(first)
            report.generated, report.in_flight_tokens = engine.generated(), engine.in_flight_tokens()
        elif through and orders.rounds.early:
            ending.end_now()  # through its groups, as an engine run empty: the placement may have other work for it
        elif orders.rounds.seconds is not None:
            ending.arrive()  # nothing to step: this rank waits at the exchange
    if orders.carry:  # the next step's requests still in flight go back to rank 0, to go on in that step
        engine = context.engines.get(context.role)
        left = [None] * d.world_size if d.rank == 0 else None
        dist.gather_object(engine.export() if engine is not None else [], left, dst=0, group=d.control)
        if d.rank == 0:  # a slot's ranks export the same requests: its first rank's go on
            queues.carry([request for exported in left[::d.slot_size] for request in exported])
    done = [(queues.ordered_samples(), {"groups": queues.trained, **queues.early, "update": queues.update},
             queues.shifts) if d.rank == 0 else None]
    dist.broadcast_object_list(done, src=0, group=d.control)
    samples, early, shifts = done[0]
    return samples, early, shifts, _extra_seconds(resumed, plain)


def publish_update(context, version: int) -> None:
    """Collective: the train ranks write their rows of the update into every node's policy storage, as
    `version` (or, where they have all left the train role since they made it, the training state they
    saved as they left does); the rollout engines load it as their ranks next take or keep the role."""
    storage = context.storage[Role.ROLLOUT]
    if Role.TRAIN in context.roles:
        storage.publish_shards([] if context.trainer is None else context.trainer.weight_rows(), version)
    else:
        context.train_state.publish_weights(storage, version)


def _read(report: Report, finished: list[tuple[Request, Completion]], step_prompts: dict[int, list[dict]],
          rollout: RolloutEngine, judge: Judge) -> None:
    """Finished rollout requests become samples with their judge requests; finished critiques, verdicts.
    `step_prompts`: the prompts of each step whose requests may be in flight."""
    try:
        for request, done in finished:
            if request.role == Role.ROLLOUT:
                sample = rollout.to_sample(request, done, step_prompts[request.step][request.key[0]])
                report.responses.append((sample, judge.request(sample, request.step)))
            else:
                report.verdicts.append(judge.verdict(request, done, request.step))
    except ParseFailure as e:
        report.error = str(e)


def _work(d, engine, orders: Orders, role: str, timeline,
          ending: RoundEnd) -> tuple[list, list[tuple[int, float, int]]]:
    """Steps `engine` until the round ends or it runs empty; returns what finished and the engine steps taken.
    In a timed round, a rank past its time goes on stepping until every rank is past its own. The ranks of
    an engine of several (--engine-tp) agree before each engine step whether to stop, as each step is
    collective among them."""
    finished, engine_steps = [], []
    prefill = sum(len(r.prompt_ids) + len(r.generated) for r in orders.work)  # taken in by the first step
    limit, start = orders.rounds, time.perf_counter()
    while engine.in_flight() and (limit.engine_steps is None or len(engine_steps) < limit.engine_steps):
        # An untimed round never stops early (RoundEnd.stop), so a slot's ranks need not ask one another.
        if limit.seconds is not None and _slot_agree(d, ending.stop(limit, start)):
            break
        begin, batch = time.perf_counter(), engine.in_flight()
        with timeline.busy(role):
            finished += engine.step()
        faults.point(role, d.rank)
        engine_steps.append((batch, time.perf_counter() - begin, prefill))
        prefill = 0
    if limit.seconds is not None:
        if limit.early and engine_steps and not engine.in_flight():
            ending.end_now()  # this rank is free: the placement may have other work for it
        else:
            ending.arrive()
    return finished, engine_steps


def _slot_agree(d, mine: bool) -> bool:
    """Whether any rank of this rank's slot says yes (one rank a slot: its own answer)."""
    if d.slot_size == 1:
        return mine
    flag = torch.tensor([int(mine)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=d.slot_group)
    return bool(flag.item())


def _train(trainer, orders: Orders, timeline, ending: RoundEnd) -> dict:
    """Early training: forward and backward over the handed groups, one group at a time, until they are
    done or the round ends; past its time the train group goes on, as an engine does, until every rank
    is past its own. Its ranks agree at each group's boundary whether to stop (whichever saw the
    round's end first), so their collectives pair up. Returns the sums and the groups trained."""
    start, sums, trained = time.perf_counter(), NO_EARLY, []
    for group in orders.train:
        if trainer.agree(ending.stop(orders.rounds, start)):
            break
        with timeline.busy(Role.TRAIN):
            sums = add_early(sums, trainer.accumulate(group))
        trained.append(group[0].group)
    return {**sums, "groups": trained}


def _extra_seconds(resumed_steps: list[float], plain_steps: list[float]) -> float:
    """What resuming migrated sequences cost this rank: the time of the engine steps that prefilled
    them beyond a typical first step of a round without such prefills."""
    if not resumed_steps or not plain_steps:
        return 0.0
    typical = sorted(plain_steps)[len(plain_steps) // 2]
    return sum(max(0.0, t - typical) for t in resumed_steps)


def _exchange(d, report: Report, queues: StepQueues | None, next_roles, roles: list[str], rng, intake,
              round_s: float) -> Orders:
    """All ranks' reports to rank 0; its orders back to each rank. Rank 0 decides for slots (--engine-tp ranks
    each: one rank at 1): a slot's ranks run one engine, so its first rank's report is the slot's, and every
    rank of a slot gets the slot's orders."""
    reports = [None] * d.world_size if d.rank == 0 else None
    dist.gather_object(report, reports, dst=0, group=d.control)
    orders = [None] * d.world_size
    if d.rank == 0:
        decided = _decide(reports[::d.slot_size], queues, next_roles, roles, rng, intake, round_s)
        orders = [decided[rank // d.slot_size] for rank in range(d.world_size)]
    mine = [None]
    dist.scatter_object_list(mine, orders if d.rank == 0 else None, src=0, group=d.control)
    return mine[0]


def _migrate(d, exported: list[Request], queues: StepQueues | None, intake) -> list[Request]:
    """A round with `Orders.migrate`, as it begins: every rank's exported requests to rank 0, which puts them
    back in their queues and dispatches the round's work (StepQueues.migrate); this rank's share back. A
    slot's ranks export the same requests: its first rank's go on, and every rank of it gets the slot's work."""
    left = [None] * d.world_size if d.rank == 0 else None
    dist.gather_object(exported, left, dst=0, group=d.control)
    work = [None] * d.world_size
    if d.rank == 0:
        shares = queues.migrate(left[::d.slot_size], intake)
        work = [shares[rank // d.slot_size] for rank in range(d.world_size)]
    mine = [None]
    dist.scatter_object_list(mine, work if d.rank == 0 else None, src=0, group=d.control)
    return mine[0]


def _decide(reports, queues: StepQueues, next_roles, roles: list[str], rng, intake,
            round_s: float) -> list[Orders]:
    error = next((r.error for r in reports if r.error), None)  # a critique under --on-parse-failure stop
    try:
        queues.ingest(reports, round_s)
    except AssertionError as e:  # a broken invariant
        error = str(e)
    if error:
        return [Orders(roles, error=f"step {queues.step}: {error}") for _ in roles]
    if queues.done():
        return _traced(queues, reports, [Orders(roles, done=True, carry=queues.ahead is not None) for _ in roles])
    # The ranks that trained the update's groups make it at the round's start, before any of them moves; its
    # weights go out then, and the next step's prompts join the queue before the roles are decided.
    update = {**queues.early, "skipped_in_row": queues.skipped_in_row} \
        if Role.TRAIN in roles and queues.update_due() else None
    publish = queues.publish() if queues.publish_due(making=update is not None) else None
    start = time.perf_counter()
    new, rounds = next_roles(roles, queues, rng)
    queues.next_roles_s += time.perf_counter() - start
    # A rank that changes role exports its in-flight requests before it takes new work: the engine of its
    # new role holds none (it exported them when it last left that role).
    in_flight = [rep.in_flight if rep.role == new[r] else 0 for r, rep in enumerate(reports)]
    # Those requests go on in this round: the round's work is dispatched once they are back in the queues.
    migrate = book.migrates([rep.role for rep in reports], [rep.in_flight for rep in reports], new)
    work = [[] for _ in new] if migrate else queues.dispatch(new, intake, in_flight, rounds.seconds)
    train = queues.hand_to_train() if queues.early_train and Role.TRAIN in new else []
    orders = [Orders(new, work=work[r], train=train if new[r] == Role.TRAIN else [],
                     update=update if roles[r] == Role.TRAIN else None, publish=publish, rounds=rounds,
                     migrate=migrate) for r in range(len(new))]
    if migrate:  # traced with its work (StepQueues.migrate)
        queues.deferred = (orders, in_flight, rounds.seconds)
        return orders
    return _traced(queues, reports, orders)


def _traced(queues: StepQueues, reports: list[Report], orders: list[Orders]) -> list[Orders]:
    """The round's orders, kept in the trace first where the step keeps one (--trace-rounds)."""
    if queues.trace is not None:
        queues.trace_round(reports, orders)
    return orders
