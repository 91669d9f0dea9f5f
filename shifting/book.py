"""Rules of the scheduling book that the training loop (shifting/scheduler.py, pivot_train.py) and the
simulator (sim/engine.py) both follow: how long a round lasts (from the step's recent engine steps) and
when it ends early, how a role's queue is shared among its engines, where exported work goes back in
it, colocated's role, and at --max-staleness K > 0 when the update is made and published during the step
and which step begins ahead of it (the partial rollout). Pure: no torch, no engines, no clocks,
so the simulator imports it as it is."""
import heapq
import math
from collections import deque

from roles import Role

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
POLL_S = 0.01  # how often a rank past its round's time looks whether the round has ended


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
                  over_longest: float = ROUND_OVER_LONGEST) -> float:
    """A timed round's length: `round_steps` engine steps at the median of the recent ones
    (FIRST_ENGINE_STEP_S before any), and at least `over_exchange` times the last exchange with rank 0
    (many ranks exchange slower than few) and `over_longest` times the longest recent engine step. The
    loop uses the defaults; the simulator's what-if runs may change them."""
    engine_step_s = FIRST_ENGINE_STEP_S if median_engine_step_s is None else median_engine_step_s
    return max(round_steps * engine_step_s, over_exchange * exchange_s, over_longest * longest_engine_step_s)


def empty_enough(ranks: int, share: float = EMPTY_SHARE) -> int:
    """How many ranks must have run empty to end a round early for every rank: `share` of them, one at least."""
    return max(1, math.ceil(ranks * share))


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


def update_due(early: bool, trained: bool, made: bool) -> bool:
    """--max-staleness K > 0: whether the train ranks make the update now, at a round's start while the
    step goes on (once the last reports are read). `early`: its groups are an earlier step's, all judged
    as the step starts, which the train ranks work through during it (a placement that trains early);
    `trained`: they have trained every one; `made`: they made it at an earlier round's start. An update
    whose last group is trained in the step's last round is made after the step, as at K = 0."""
    return early and trained and not made


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
