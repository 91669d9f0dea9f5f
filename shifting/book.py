"""Rules of the scheduling book that the training loop (shifting/scheduler.py, pivot_train.py) and the
simulator (sim/engine.py) both follow: how long a round lasts (from the step's recent engine steps) and
when it ends early, how a role's queue is shared among its engines, where exported work goes back in
it, colocated's role, and at --max-staleness K > 0 when the update is made and published during the step
and which step begins ahead of it (the partial rollout). Pure: no torch, no engines, no clocks,
so the simulator imports it as it is.

`Book` is the one step's bookkeeping both keep: the loop's rank 0 (StepQueues in shifting/scheduler.py,
which holds the requests and samples behind its numbers) and the simulator (sim/engine.py Step, which holds
their drawn lengths) read their reports into it and take their orders' work and hand-outs from it."""
import heapq
import math
from collections import deque
from collections.abc import Callable

import numpy as np

from roles import ENGINE_ROLES, Role

ROUND_STEPS = 25  # --round-steps: a timed round lasts this many engine steps' worth of time, at the median step
FIRST_ENGINE_STEP_S = 0.002  # the engine step's seconds assumed before the RL step has measured one
# The engine steps a round's length is taken from: the RL step's last ones, this many per rank. Counted over
# all ranks, a fixed number would shrink to a step or two of each rank's among many ranks, less than a round,
# so the longest of them would forget the prefill chunks every round's new work brings.
RECENT_ENGINE_STEPS = 256
ROUND_OVER_EXCHANGE = 20  # a timed round lasts at least this many exchanges: they cost 5% of it at most
# ... and this many of the longest recent engine steps (a prefill chunk): at its end every rank waits for
# the steps in progress, a tenth of the round at most
ROUND_OVER_LONGEST = 10
# A round ends early once this share of the ranks (one at least) has run empty: every early end stops
# every rank for an exchange, so among many ranks it waits for enough freed ones to be worth that.
EMPTY_SHARE = 1 / 8
# How long after a round's end a rank past its time learns of it: the store's answer to the wait its
# thread keeps (RoundEnd) and the thread's wake-up, 0.2 ms on an idle core here, and the median of a
# store round trip on this machine's loaded cores 0.4 ms (docs/placements.md).
NOTICE_S = 0.0004
# --updates ready at --max-staleness K >= 2: a step's rounds may end once no more than this share of its
# groups is still out (the step after it begun, and every group carried in from the step before judged);
# those go on in the next step and train in the update after their own, K updates after the weights that
# began them (`Book.may_end`, `Book.spill`). So an update trains between 1 - SPILL_SHARE and 1 + SPILL_SHARE
# steps' worth of groups.
SPILL_SHARE = 0.5
# pivot's judge intake at K = 0 (`intake`): an engine takes in critiques while its engine step stays within
# (1 + this) times its fixed part: beyond that batch a critique more adds less than half a critique's throughput.
INTAKE_KNEE = 1.0


class RecentSteps:
    """A step's last RECENT_ENGINE_STEPS engine steps per rank of `ranks`, every rank's together, as runs of
    equal ones (seconds, count): the loop adds each step it hears of, the simulator a run of steps at one
    speed. A round's length is taken from their median and the longest (`round_seconds`)."""

    def __init__(self, ranks: int = 1, keep: int = RECENT_ENGINE_STEPS):
        self.keep, self.runs, self.count = keep * ranks, deque(), 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.runs.append([seconds, count])
        self.count += count
        while self.count - self.runs[0][1] >= self.keep:  # whole runs beyond the last `keep` steps go
            self.count -= self.runs.popleft()[1]
        if self.count > self.keep:  # and the oldest run keeps what of it is among them
            self.runs[0][1] -= self.count - self.keep
            self.count = self.keep

    def median(self) -> float | None:
        """The lower median of the steps kept; None before any."""
        seen = 0
        for seconds, count in sorted(self.runs):
            seen += count
            if 2 * seen >= self.count:
                return seconds
        return None

    def longest(self) -> float:
        return max((seconds for seconds, _ in self.runs), default=0.0)


def round_seconds(round_steps: int, median_engine_step_s: float | None, longest_engine_step_s: float,
                  exchange_s: float, *, over_exchange: float = ROUND_OVER_EXCHANGE,
                  over_longest: float = ROUND_OVER_LONGEST, first_engine_step_s: float = FIRST_ENGINE_STEP_S) -> float:
    """A timed round's length: `round_steps` engine steps at the median of the recent ones
    (`first_engine_step_s` before any), and at least `over_exchange` times the last exchange with rank 0
    (many ranks exchange slower than few) and `over_longest` times the longest recent engine step. The
    loop uses the defaults; the simulator's what-if runs may change them."""
    engine_step_s = first_engine_step_s if median_engine_step_s is None else median_engine_step_s
    return max(round_steps * engine_step_s, over_exchange * exchange_s, over_longest * longest_engine_step_s)


def slot_shape(tensor_parallel: dict[str, int]) -> tuple[int, dict[str, int]]:
    """A slot: what the planner moves, the scheduler orders and a placement counts. It is the ranks (devices)
    one engine of the widest engine role spans (`tensor_parallel`: role -> ranks per engine), holds one role
    at a time, and runs as many engines of each role as fit in it. Returns the slot's ranks and each engine
    role's engines per slot. The loop's engines all span --engine-tp ranks: one engine a slot."""
    size = max(tensor_parallel.values())
    for role, tp in tensor_parallel.items():
        if tp < 1 or size % tp:
            raise ValueError(f"a {role} engine of {tp} ranks does not divide a slot of {size}")
    return size, {role: size // tp for role, tp in tensor_parallel.items()}


def slot_ranks(slot: int, size: int) -> range:
    """The ranks of slot `slot`, slots of `size` ranks in rank order (vLLM's layout of engines over the torch
    world under its external launcher: initialize_model_parallel in vllm/distributed/parallel_state.py)."""
    return range(slot * size, (slot + 1) * size)


def rank_roles(slot_roles: list[str], size: int) -> list[str]:
    """Each rank's role, from each slot's."""
    return [role for role in slot_roles for _ in range(size)]


def empty_enough(ranks: int, share: float = EMPTY_SHARE) -> int:
    """How many ranks must have run empty to end a round early for every rank: `share` of them, one at least.
    A train rank through every group handed to it in the round counts as run empty."""
    return max(1, math.ceil(ranks * share))


def migrates(roles: list[str], in_flight: list[int], new: list[str]) -> bool:
    """Whether a round begins with a migration: some rank leaves its role (`roles` to `new`) with requests in
    flight (`in_flight`), which go back to rank 0 and on, in that round, on the ranks of their role."""
    return any(n and role != to for role, n, to in zip(roles, in_flight, new))


def shares(queued: int, in_flight: list[int], capacity: int) -> list[int]:
    """How many of `queued` requests each engine of one role takes, given the requests each already runs:
    one at a time to the engine running fewest (the lowest rank among equals), never above `capacity`.
    So the engines' loads even out: a rank that has just run empty beside one still running a full batch
    takes the whole queue, where equal shares of the queue would leave half of it waiting a round while
    the empty rank idles (the batch an engine runs sets its speed, not the queue's length)."""
    take = [0] * len(in_flight)
    room = [(n, rank) for rank, n in enumerate(in_flight) if n < capacity]
    heapq.heapify(room)
    for _ in range(queued):
        if not room:
            break
        n, rank = heapq.heappop(room)
        take[rank] += 1
        if n + 1 < capacity:
            heapq.heappush(room, (n + 1, rank))
    return take


def intake(role: str, step_s: float, per_seq_s: float, room: int, role_seqs: int, ranks: int,
           round_s: float | None = None, critique_tokens: float = 0.0, knee: float = INTAKE_KNEE) -> int:
    """The most sequences one of pivot's engines takes in. A judge engine takes as many as keep its engine
    step within (1 + `knee`) times its fixed part (an engine step is `step_s` + `per_seq_s` x its
    sequences, the planner's fit), or as many as it writes whole within a round of `round_s` seconds (each
    a critique of `critique_tokens`, the mean), whichever is more, but never fewer than its even share of
    the judge's `role_seqs` (queued and running) over all `ranks`, nor more than its `room` (--max-seqs).
    What the first judge engines would crowd in (a longer batch adds little throughput and slows every
    critique in it, the longest to the step's end) waits at rank 0 instead for the ranks that join the
    judge (at K = 0 every rollout rank, as the rollout ends; at K > 0 the rollout ranks with nothing
    running), as serving routers balance by each engine's outstanding work, not by its room. It pays most
    where a step's tail is long (the simulator's paper preset, its 1.5B and 7B groups) and costs the
    work-bound groups a little (smaller judge batches where no rank idles); `bench/sim_whatif.py --cases
    "as calibrated,judge room"` measures both. Where critiques are short beside a round (this machine's
    longtail workload: 17 tokens on average, a round some 60 engine steps) an engine at the knee batch
    would write its critiques early in the round and step a few long ones to its end while the rest wait
    at rank 0 (the CPU simulation of bench/results/placements-longtail.json: the first judge rank's decode
    at 1,520 tokens/s, colocated's at 2,270-2,660): what it finishes within the round it takes. A rollout
    engine takes its room: a step's prompts are queued at its start, when no rank is about to join
    rollout; so does a judge engine whose fit measured no cost a sequence."""
    if role != Role.JUDGE or per_seq_s <= 0:
        return room
    steps_well = math.ceil(knee * step_s / per_seq_s)
    within = math.floor((round_s / critique_tokens - step_s) / per_seq_s) if round_s and critique_tokens > 0 else 0
    return max(1, min(room, max(steps_well, within, math.ceil(role_seqs / ranks))))


def prefill_budget(role: str, synchronous: bool, seconds: float | None, prefill_per_s: float,
                   roles: tuple[str, ...] = (Role.JUDGE,),
                   until_empty_s: Callable[[], float | None] = lambda: None) -> float | None:
    """The context tokens of new work one of pivot's engines takes in at a round's start: in a timed round
    (`seconds`) of a `synchronous` run (--max-staleness 0) a judge engine takes only what it prefills in the
    round (at `prefill_per_s`), one request at least (`within_budget`); the rest waits at rank 0, where
    the planner sees it and a rank that joins the judge takes it. None: no budget. The first judge engines
    of such a step would otherwise take in responses as they finish, up to their intake (`intake`), and
    the ranks that join the judge as the rollout ends find the queue empty. What it is worth at each of
    the simulator's groups: `bench/sim_whatif.py --max-staleness 0 --cases "as calibrated,no prefill
    budget"`. `roles`: the engine roles that keep a budget, the judge's in the loop (the simulator's
    what-ifs add others). Where the rollout engines are expected to run empty sooner, enough of them to end
    the round early (`until_empty_s()`, called only where a budget applies: planner.first_empty_seconds),
    only what it prefills by then: an engine step is not cut, so a judge prefill still running when the
    round ends holds every rank, and the rollout ranks that ran empty join the judge only after it (the CPU
    simulation of bench/results/placements-task.json, pivot@0: a rank that joined the judge as the other
    wrote its last 2 responses prefilled 63 judge prompts while that one, empty, waited 0.13 s)."""
    if role not in roles or not synchronous or seconds is None:
        return None
    until_empty = until_empty_s()
    return (seconds if until_empty is None else min(seconds, until_empty)) * prefill_per_s


def within_budget(contexts: list[float], budget: float | None) -> int:
    """How many of an engine's new requests (their context tokens, in the order it takes them) fit its
    prefill `budget` (`prefill_budget`): its first whatever its size; all of them without a budget."""
    if budget is None or not contexts:
        return len(contexts)
    return max(1, int(np.searchsorted(np.cumsum(contexts), budget, side="right")))


def update_due(early: bool, trained: bool, made: bool) -> bool:
    """--max-staleness K > 0: whether the train ranks make the update now, at a round's start while the
    step goes on (once the last reports are read). `early`: its groups are an earlier step's, all judged
    as the step starts, which the train ranks work through during it (a placement that trains early);
    `trained`: they have trained every one; `made`: they made it at an earlier round's start. An update
    whose last group is trained in the step's last round is made after the step, as at K = 0."""
    return early and trained and not made


def update_roles(roles: list[str], split: list[str] | None, alone: bool) -> list[str]:
    """Who makes the update once the step's rounds are over, where no round's start made it (`update_due`):
    a fixed `split` keeps its roles; where the train ranks make it `alone` (planner.update_seconds: no
    slower than every rank, always so once they have trained every group early), they keep their
    gradients and the others their engines (bringing every rank in reshards the training state and
    the gradients, and sends every rank back to its engine after); else every rank trains the groups
    left, since nothing else is left to do in the step."""
    if split:
        return list(split)
    if alone and Role.TRAIN in roles:
        return list(roles)
    return [Role.TRAIN] * len(roles)


def next_step_roles(held: list[str], start: list[str], keep: bool) -> list[str]:
    """The roles the next step begins with, once the update is published: `start` (colocated's and pivot's
    every rank in rollout, a fixed split's own), but pivot's at --max-staleness K > 0 (`keep`) those its
    ranks `held` as the step's rounds ended. There the next update's groups are judged as the step begins,
    so its train ranks have work at once; sending them to rollout would cost each two shifts and every
    rank a reshard of the training state as the planner moved them back (`python -m sim --model-group
    dense-32b-32b --max-staleness 2 --steps 6`, seed 0: 608.6 s an update, where every step begun in
    rollout took 639.0 s and disaggregated@2 takes 619.2 s)."""
    return list(held) if keep else list(start)


def publish_due(made: bool, published: bool, ahead: bool) -> bool:
    """Whether the update goes out now, at a round's start while the step goes on: made at an earlier
    round's start (`update_due`), not published yet, and a next step to begin (`ahead`: `ahead_step` gave
    one), whose prompts join the queue at once. Else it goes out at the step's end."""
    return made and not published and ahead


def ahead_step(step: int, max_staleness: int, steps: int, checkpoint: bool) -> int | None:
    """The step that may begin during step `step`'s rollout, once the update beside it is published: at
    --max-staleness K > 0 the next one, unless the run's `steps` leave none to roll out or the update
    ends in a `checkpoint`, which holds whole steps, none in flight. None: no step begins ahead."""
    return step + 1 if max_staleness > 0 and not checkpoint and step + 1 < steps else None


def requeue(queue: deque, exported: list) -> None:
    """Work a rank exported (a shift, or the step's end) goes back to the head of its role's queue, in the
    order the rank exported it, ahead of what was queued: it holds the oldest sequences of the step."""
    queue.extendleft(reversed(exported))


def colocated_role(role: str, rollout_left: bool, judging: bool) -> str:
    """Colocated's role for every rank, from the ranks' `role` now: rollout while rollout has work left
    (`rollout_left`: queued or in flight), then the judge; once the ranks judge, they stay while the
    judge has work queued or in flight (`judging`), so that prompts admitted meanwhile (--filter-groups)
    wait for it: one switch back, not one a round."""
    return Role.ROLLOUT if rollout_left and not (role == Role.JUDGE and judging) else Role.JUDGE


# A sample's phase in the book: queued for rollout, rolling out, its response queued for the judge, being
# judged, judged.
QUEUED, ROLLING, RESPONDED, JUDGING, JUDGED = range(5)
IN_FLIGHT = {Role.ROLLOUT: ROLLING, Role.JUDGE: JUDGING}


class Book:
    """One step's scheduling book: where each of its samples is (`phase`), each engine role's queue, the
    groups' verdicts still to come, the groups handed to the train ranks and those left out, and the step's
    recent engine steps and last exchange, which time its rounds. Samples are numbered prompt x G + sample;
    once the next step begins during this one (`extend`) its samples follow this step's `n` in every array
    and queue, until the step ends and `carry` takes them out again; a step begun after it follows it so
    (the loop begins one at most; the simulator's `deep_pipeline` what-if, --max-staleness of them). `admitted`: the samples queued at once
    (--filter-groups admits the others group by group, `drop`); all of them by default."""

    SAMPLE_ARRAYS = ("phase", "tokens")  # per sample, what `extend` joins and `carry` splits (a subclass adds its own)
    GROUP_ARRAYS = ("group_left", "trained", "dropped")

    def __init__(self, samples: int, group_size: int, *, ranks: int = 1, admitted: int | None = None):
        self.n, self.group_size = samples, group_size
        admitted = samples if admitted is None else admitted
        self.phase = np.full(samples, QUEUED, dtype=np.int8)
        self.tokens = np.zeros(samples)  # prompt + response tokens, once generated: what training it takes
        self.queue = {Role.ROLLOUT: deque(range(admitted)), Role.JUDGE: deque()}
        self.held = deque(range(admitted, samples))  # not admitted yet, in order
        self.expected = admitted  # samples the step judges: it is done once it has judged them
        groups = samples // group_size
        self.group_left = np.full(groups, group_size, dtype=np.int64)  # verdicts each group still waits for
        self.trained = np.zeros(groups, dtype=bool)  # by the train ranks, into the update
        self.dropped = np.zeros(groups, dtype=bool)  # left out of the update
        self.generated = self.judged = 0  # of its own samples
        self.recent_steps = RecentSteps(ranks)
        self.exchange_s = 0.0  # the step's last exchange with rank 0: none before its first
        self.aheads: list[Book] = []  # the next steps, begun during this one, in order
        self.carried_in = 0  # groups at its head that went on from the step before (`spill`): at the bound

    @classmethod
    def judged_pool(cls, tokens: dict[int, int], group_size: int) -> "Book":
        """The book of an update's groups judged in an earlier step (--max-staleness K > 0), from each
        sample's tokens by its number: every sample judged; the prompts of that step without samples in
        it are left out."""
        groups = sorted({i // group_size for i in tokens})
        pool = cls((max(groups, default=-1) + 1) * group_size, group_size)
        pool.phase[:], pool.group_left[:], pool.dropped[:] = JUDGED, 0, True
        pool.tokens[list(tokens)] = list(tokens.values())
        pool.dropped[groups] = False
        pool.queue[Role.ROLLOUT].clear()
        pool.generated = pool.judged = pool.expected = len(groups) * group_size
        return pool

    def _own(self, i: int) -> "Book":
        """The book that counts sample i: this step's, or that of a next step, begun during it."""
        if i < self.n:
            return self
        for book in [self] + self.aheads:
            if i < book.n:
                return book
            i -= book.n
        raise IndexError(f"sample {i} is beyond the steps begun")

    # -- reports ------------------------------------------------------------------------------------

    def respond(self, i: int, tokens: float) -> None:
        """Sample i's response finished, its prompt and response `tokens` long: it is queued for the judge."""
        assert self.phase[i] == ROLLING, f"sample {i} generated twice"
        self.phase[i], self.tokens[i] = RESPONDED, tokens
        self._own(i).generated += 1
        self.queue[Role.JUDGE].append(i)

    def judge(self, i: int) -> bool:
        """Sample i's verdict came in: whether it completes its group."""
        assert self.phase[i] == JUDGING, f"sample {i} judged twice"
        self.phase[i] = JUDGED
        self._own(i).judged += 1
        group = i // self.group_size
        self.group_left[group] -= 1
        return bool(self.group_left[group] == 0)

    def retry(self, i: int) -> None:
        """Sample i's critique is to be written again (--on-parse-failure retry): it queues for the judge anew."""
        assert self.phase[i] == JUDGING, f"sample {i} is not being judged"
        self.phase[i] = RESPONDED
        self.queue[Role.JUDGE].append(i)

    def requeue(self, exported: list[int]) -> None:
        """Samples an engine exported (a shift, or the step's end) go back to the head of their queue, in
        the order exported (`requeue`): a response not finished to rollout's, a critique to the judge's."""
        for i in exported:
            assert self.phase[i] in (ROLLING, JUDGING), f"sample {i} exported while not in flight"
            self.phase[i] -= 1
        for role in ENGINE_ROLES:
            requeue(self.queue[role], [i for i in exported if self.phase[i] == IN_FLIGHT[role] - 1])

    def ingest(self, finished: list[int], exported: list[int], tokens) -> list[int]:
        """One rank's report, read in rank order: its finished responses (`tokens(i)` long, prompt and
        response) join the judge's queue, its verdicts complete groups, and what it exported goes back to
        the head of its queue. Returns the groups its verdicts completed."""
        complete = []
        for i in finished:
            if self.phase[i] == ROLLING:
                self.respond(i, float(tokens(i)))
            elif self.judge(i):
                complete.append(i // self.group_size)
        self.requeue(exported)
        return complete

    def drop(self, group: int) -> list[int]:
        """--filter-groups: a group judged with equal rewards leaves the update, and the next group held,
        if any, is admitted in its place (queued for rollout now). Returns the samples admitted."""
        assert self.group_left[group] == 0 and not self.trained[group], f"group {group} left out unjudged or trained"
        self.dropped[group] = True
        admitted = [self.held.popleft() for _ in range(min(self.group_size, len(self.held)))]
        self.queue[Role.ROLLOUT].extend(admitted)
        self.expected += len(admitted)
        return admitted

    # -- orders -------------------------------------------------------------------------------------

    def dispatch(self, role: str, in_flight: list[int], capacity: int, budget: float | None = None,
                 context=None) -> list[list[int]]:
        """The role's queue shared among the ranks holding it, given what each runs (`shares`), in rank
        order from the queue's head; with a prefill `budget` (`prefill_budget`) each rank keeps of its
        share what fits it (`within_budget`, by `context(i)`: sample i's context tokens), and the rest goes
        back to the head of the queue, in order."""
        queue = self.queue[role]
        work = [[queue.popleft() for _ in range(take)] for take in shares(len(queue), in_flight, capacity)]
        if budget is not None:
            back = []
            for k, new in enumerate(work):
                keep = within_budget([context(i) for i in new], budget)
                back += new[keep:]
                work[k] = new[:keep]
            requeue(queue, back)
        for new in work:
            self.phase[new] = IN_FLIGHT[role]
        return work

    def ready(self) -> list[int]:
        """Early training: the update's groups judged, not left out, and not trained, in prompt order. The
        train ranks are handed them all at a round's start, work through them one at a time until the
        round ends, and report those they reached (`train`); the others are handed out again."""
        own = self.n // self.group_size  # the groups of the next step, begun during this one, follow
        return np.flatnonzero((self.group_left[:own] == 0) & ~self.trained[:own] & ~self.dropped[:own]).tolist()

    def train(self, groups: list[int]) -> None:
        """The train ranks trained `groups` in the round just ended."""
        assert not self.trained[groups].any(), f"groups {groups} trained twice"
        self.trained[groups] = True

    def train_work(self) -> tuple[float, float, int]:
        """What the update has left to train, as rank 0 tells the planner (planner.step_work): the tokens
        of its groups `ready`, those of its samples generated so far and not trained (nor left out), and
        how many of its samples are still to be generated (queued or rolling out; none held back)."""
        own, g = self.n // self.group_size, self.group_size
        left = np.repeat(~self.trained[:own] & ~self.dropped[:own], g)
        ready = np.zeros(own, dtype=bool)
        ready[self.ready()] = True
        generated = self.phase[:self.n] >= RESPONDED
        tokens = self.tokens[:self.n]
        coming = int((left & ~generated).sum()) - len(self.held)
        return float(tokens[np.repeat(ready, g)].sum()), float(tokens[left & generated].sum()), coming

    def through(self) -> bool:
        """Whether the train ranks have trained every group of the update, or it was left out."""
        own = self.n // self.group_size
        return bool((self.dropped[:own] | self.trained[:own]).all())

    def round_seconds(self, round_steps: int, **rules) -> float:
        """The next timed round's length (`round_seconds`), from the step's recent engine steps and its last
        exchange."""
        return round_seconds(round_steps, self.recent_steps.median(), self.recent_steps.longest(),
                             self.exchange_s, **rules)

    def colocated(self, role: str, in_flight: dict[str, int]) -> tuple[str, bool]:
        """Colocated's role for every rank (`colocated_role`), from the ranks' `role` now and the sequences
        each engine role has `in_flight`, and whether the round is timed: only while that role has work
        queued. With none queued nothing can change before every engine has run empty, so the ranks
        report once, then; with work queued a rank that runs empty ends the round so that it gets some."""
        queue = self.queue
        new = colocated_role(role, bool(queue[Role.ROLLOUT] or in_flight[Role.ROLLOUT]),
                             bool(queue[Role.JUDGE] or in_flight[Role.JUDGE]))
        return new, bool(queue[new])

    def done(self) -> bool:
        """Every sample the step admitted is judged."""
        return self.judged == self.expected

    def may_end(self, spill: float = SPILL_SHARE) -> bool:
        """--updates ready: whether the step's rounds may end with some of its groups still out, to go on in
        the next step and train an update later: the next step has begun, every group carried in from the
        step before is judged (it is at the bound: its update cannot wait for a later one), and at most a
        `spill` share of the step's own groups is still out. A bound per group, as the staleness buffers of
        the paper's release keep it (victor-yfzhao/psrl pivotrl/workers/ps/staleness_controller.py: a sample
        begun under version v may enter the buffers of updates v to v + K), where a step-locked update
        waits for its step's slowest group."""
        could_end, bound_out = self._ending(spill)
        return could_end and not bound_out

    def waits_for_bound(self, spill: float = SPILL_SHARE) -> bool:
        """Whether the step's rounds go on only for groups carried in from the step before: it could end
        but for them (`may_end`)."""
        could_end, bound_out = self._ending(spill)
        return could_end and bound_out

    def _ending(self, spill: float) -> tuple[bool, bool]:
        """Whether the step could end but for its carried-in groups (the next step begun, at most a `spill`
        share of its own groups out), and whether any carried-in group is still out."""
        own = self.n // self.group_size
        out = self.group_left[:own] > 0
        return bool(self.aheads) and out.sum() <= spill * own, bool(out[:self.carried_in].any())

    def spill(self) -> np.ndarray:
        """--updates ready, as the step ends with groups still out (`may_end`): they move behind its judged
        ones, so that `carry` takes them into the next step's book, at its head (its `carried_in`). Returns
        each sample's new number, by its old one."""
        g, own = self.group_size, self.n // self.group_size
        out = self.group_left[:own] > 0
        groups = np.concatenate([np.flatnonzero(~out), np.flatnonzero(out), np.arange(own, len(self.group_left))])
        order = (groups[:, None] * g + np.arange(g)).ravel()
        for name in self.SAMPLE_ARRAYS:
            setattr(self, name, getattr(self, name)[order])
        for name in self.GROUP_ARRAYS:
            setattr(self, name, getattr(self, name)[groups])
        number = np.empty(len(order), dtype=np.int64)
        number[order] = np.arange(len(order))
        self.queue = {role: deque(int(number[i]) for i in queue) for role, queue in self.queue.items()}
        kept = int((~out).sum()) * g
        tail, ahead = self.phase[kept:self.n], self.aheads[0]
        ahead.n, ahead.expected = ahead.n + len(tail), ahead.expected + len(tail)
        ahead.generated += int((tail >= RESPONDED).sum())
        ahead.judged += int((tail == JUDGED).sum())
        ahead.carried_in = int(out.sum())
        self.n = self.generated = self.judged = self.expected = kept
        return number

    def judging_left(self) -> bool:
        """Verdicts still to come, of this step or of the next ones, begun during it."""
        return not all(book.done() for book in [self] + self.aheads)

    # -- the next step, begun during this one ---------------------------------------------------------

    def extend(self, ahead: "Book") -> None:
        """The next step's samples join this step's arrays, after its own `n` and those of the steps begun
        before it, and its rollout queue behind what is queued (the update published during this step);
        `carry` takes them out again."""
        offset = self.n + sum(book.n for book in self.aheads)
        self.aheads.append(ahead)
        for name in self.SAMPLE_ARRAYS + self.GROUP_ARRAYS:
            setattr(self, name, np.concatenate([getattr(self, name), getattr(ahead, name)]))
        self.queue[Role.ROLLOUT].extend(i + offset for i in ahead.queue[Role.ROLLOUT])

    def carry(self, exported: list[int]) -> "Book":
        """As the step ends (every own sample judged): the next step's book, with what of it (and of the
        steps begun after it) is done, its queues and, first in them, the sequences the engines export now."""
        ahead, n, groups = self.aheads[0], self.n, self.n // self.group_size
        assert all(i >= n for queue in self.queue.values() for i in queue), "a request of the ending step is left"
        for name in self.SAMPLE_ARRAYS + self.GROUP_ARRAYS:
            whole, cut = getattr(self, name), n if name in self.SAMPLE_ARRAYS else groups
            setattr(ahead, name, whole[cut:].copy())
            setattr(self, name, whole[:cut])
        ahead.queue = {role: deque(i - n for i in queue) for role, queue in self.queue.items()}
        ahead.requeue([i - n for i in exported])
        ahead.aheads, self.aheads = self.aheads[1:], []
        return ahead
