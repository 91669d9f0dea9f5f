"""The planner: which role each rank holds next, from what is left of the step, each role's measured
speed and the measured cost of each kind of shift. Pure and deterministic: dataclasses in, moves out;
no clocks, no torch.distributed, no engines, so tests and the simulator (sim/) run this same code.

The model behind a decision (one step of synchronous GRPO, the three roles in a chain):
  rollout  decode is memory-bound: an engine step costs a fixed read of the weights plus a term per
           running sequence, and the step's rollout needs at least one engine step per token of its
           longest sequence. So with k ranks it takes  max(longest, tokens / (k x max_seqs)) x fixed
           + per_seq x tokens / k  (+ prefill): in the tail the first term dominates and does not
           shrink with k; the ranks it keeps there are mostly paying the weights' read for a few
           sequences. That is the time a move buys back.
  judge    judges responses as they finish; whatever its ranks have not judged when rollout ends,
           they judge together with the rollout ranks, which come over then (paying the shift).
  train    the update on judged groups: on every rank at the end of the step, and, when the caller
           allows early training, on the train ranks as groups complete (credited only with the
           groups already judged; charged the reshard into the whole group at the update,
           `costs[("train", "train")]`, which every rank waits for).
`finish_seconds` predicts the step's remaining time from that chain. A move of m ranks from one role
to another is taken only when the time it saves beats (1 + margin) x its cost (the shift, plus the
prefill of the sequences it migrates), and a rank that moved stays for `dwell` x the cost of its next
move (hysteresis against thrash; verl's separate_async switch likewise moves its threshold only after
2 consecutive idle or calm steps, verl docs/advance/v1_async_trainer.md); none leaves rollout with more
sequences than its ranks run at once while no prompt waits, where the step waits for every sequence
(`_overflows`). Two rules come first, cost or
not: a role with work it can do now and no rank gets one (from rollout only where that leaves no such
queue); while responses wait for the judge and no prompt
waits for rollout, rollout ranks with nothing running join the judge (all of them once rollout has
ended, before that as many as the waiting responses fill). At --max-staleness K > 0 the update's groups
are an earlier step's, judged before the step starts, so training them is such work: the train role
holds a rank from the step's start until they are trained, and the update made then is published during
the step, which lets the next step's rollout fill this one's tails (shifting/book.py publish_due). Where
the step may end with groups still out (--updates ready at K >= 2), its longest responses and critiques go
on into the next step, so the model weighs the rollout's and the judge's bulk and the update's training
instead of them.
"""
import math
from dataclasses import dataclass, replace

import numpy as np

from roles import ENGINE_ROLES, ROLES, Role
from shifting import book


@dataclass(frozen=True)
class Rank:
    role: str
    in_flight_tokens: int = 0  # prompt + generated tokens of its running sequences: what a move prefills again
    since_shift_s: float = math.inf  # seconds since it last changed role


@dataclass(frozen=True)
class Work:
    """What is left of one step. Token counts are expectations (see LengthEstimate)."""
    rollout_seqs: int = 0  # sequences not finished, queued or running
    rollout_tokens: float = 0.0  # tokens they still have to decode
    rollout_longest: float = 0.0  # tokens the longest of them still has to decode: the tail
    rollout_prefill: float = 0.0  # prompt tokens of queued sequences
    judge_seqs: int = 0  # responses waiting for the judge or being judged
    judge_tokens: float = 0.0  # critique tokens still to write for them
    judge_longest: float = 0.0  # critique tokens the longest of them still has to write
    judge_prefill: float = 0.0  # judge-prompt tokens of the waiting ones
    critique_tokens: float = 0.0  # expected critique of each response still to come
    judge_prompt_tokens: float = 0.0  # expected judge prompt (prompt + response) of each one to come
    train_ready: float = 0.0  # tokens of complete, judged groups not yet trained on
    train_tokens: float = 0.0  # tokens the step's update still has to process, ready or to come
    # The update's groups are an earlier step's (--max-staleness > 0): the train ranks make the update as
    # soon as they are through them, and the step then ends without one on every rank.
    update_early: bool = False
    # The step may end with some of its groups still out, which go on in the next step (--updates ready at
    # K >= 2: shifting/book.py Book.may_end): with `update_early`, its longest critique holds no update.
    spill: bool = False


@dataclass(frozen=True)
class EngineSpeed:
    """One rank's engine: seconds per engine step = step_s + per_seq_s x running sequences."""
    step_s: float
    per_seq_s: float
    prefill_per_s: float  # prefill tokens per second
    max_seqs: int  # sequences one engine runs at once


@dataclass(frozen=True)
class Speeds:
    rollout: EngineSpeed
    judge: EngineSpeed
    train_per_s: float  # tokens per second per train rank, forward and backward
    # An engine step's time while a rank trains beside it, over its time without: ranks that share cores
    # and memory bandwidth slow each other (1: devices of their own). What an early train move costs the
    # engine roles it leaves.
    beside_train: float = 1.0


@dataclass(frozen=True)
class PlannerConfig:
    margin: float = 0.5  # a move must save (1 + margin) x its cost
    dwell: float = 2.0  # after a move a rank stays dwell x the cost of its next move
    early_train: bool = False  # may ranks train on complete groups while the step still rolls out and judges
    min_train_ranks: int = 1  # the fewest ranks that can hold the policy's training state


@dataclass(frozen=True)
class Move:
    rank: int
    src: str
    dst: str


def plan(ranks: list[Rank], work: Work, speeds: Speeds, costs: dict[tuple[str, str], float],
         config: PlannerConfig = PlannerConfig()) -> list[Move]:
    """The moves to make now; none when nothing pays. `costs[(a, b)]` is the measured seconds of a
    shift from a to b. Every role with work it can do now keeps or gets a rank, cost or not."""
    ranks, moves = list(ranks), []
    for role in _starved(ranks, work):
        for move in _give_ranks(ranks, work, role, config.min_train_ranks if role == Role.TRAIN else 1,
                                speeds.rollout.max_seqs):
            moves.append(move)
            ranks[move.rank] = replace(ranks[move.rank], role=role, since_shift_s=0.0)
    waiting = _judge_waiting(work)
    if not work.rollout_prefill and waiting:
        # A rollout rank with nothing running, while no prompt waits for rollout, gives nothing up by
        # judging, and responses wait for the judge. Once rollout has ended every rollout rank goes
        # (finish_seconds has them join the judge then; left where they are they would idle until the
        # update). Before that, as many go as the waiting responses fill, and sequences still rolling
        # out keep a rank: finish_seconds may see no gain (it has the judge drain its queue during
        # rollout's tail), but a queue that waits is judge work that idle ranks could be doing.
        idle = [i for i, r in enumerate(ranks) if r.role == Role.ROLLOUT and not r.in_flight_tokens]
        if work.rollout_seqs:
            busy = sum(r.role == Role.ROLLOUT for r in ranks) - len(idle)
            idle = idle[:min(-(-waiting // speeds.judge.max_seqs), len(idle) - (0 if busy else 1))]
        for i in idle:
            moves.append(Move(i, Role.ROLLOUT, Role.JUDGE))
            ranks[i] = replace(ranks[i], role=Role.JUDGE, since_shift_s=0.0)
    # Each pass moves ranks that then may not move again (dwell), so this ends.
    while (best := _best_move(ranks, work, speeds, costs, config)) is not None:
        moving, dst = best
        for rank in moving:
            moves.append(Move(rank, ranks[rank].role, dst))
            ranks[rank] = replace(ranks[rank], role=dst, since_shift_s=0.0, in_flight_tokens=0)
    return moves


def apply_moves(roles: list[str], moves: list[Move]) -> list[str]:
    roles = list(roles)
    for move in moves:
        assert roles[move.rank] == move.src, (move, roles)
        roles[move.rank] = move.dst
    return roles


def finish_seconds(work: Work, counts: dict[str, int], speeds: Speeds, costs: dict[tuple[str, str], float],
                   early_train: bool = False) -> float:
    """Predicted seconds until the step's update is done with `counts` ranks per role now, if rollout
    ranks join the judge when rollout ends and every rank trains once judging ends (what the train ranks
    have not trained by then; with `work.update_early`, nothing when they have trained it all). Where the
    step may also end with groups still out (`work.spill` beside `update_early`), until the judge is
    through the bulk of its work and the train ranks through the update, whichever is later: the
    update's publish begins the next step, whose rollout fills this one's tail, and its longest critique
    goes on into the next step, as its longest responses do (`step_work` weighs the rollout's bulk). The
    simulator's paper preset, 1.5B group, seed 0, K = 2: weighing that critique, the planner left about
    100 slots idle in the judge for 175 s while 9 trained the update."""
    r, g, t = counts.get(Role.ROLLOUT, 0), counts.get(Role.JUDGE, 0), counts.get(Role.TRAIN, 0) if early_train else 0
    n = sum(counts.values())
    ready_first = work.update_early and work.spill
    if t:
        speeds = replace(speeds, rollout=_slowed(speeds.rollout, speeds.beside_train),
                         judge=_slowed(speeds.judge, speeds.beside_train))
    rollout = engine_seconds(speeds.rollout, r, work.rollout_seqs, work.rollout_tokens, work.rollout_longest,
                             work.rollout_prefill)
    judge = rollout
    seqs, tokens, prefill = _judge_work(work)
    if seqs:
        need = engine_seconds(speeds.judge, 1, seqs, tokens, 0.0, prefill)  # rank-seconds at full batch
        left = need - min(need, g * rollout)
        joining = n - t - g if work.rollout_seqs else 0
        if g + joining == 0:
            return math.inf
        last = _one_critique(speeds.judge, work.critique_tokens) if work.rollout_seqs else 0.0
        judge = max(rollout + last, rollout + (left + joining * costs[(Role.ROLLOUT, Role.JUDGE)]) / (g + joining))
        if not ready_first:  # ... and its longest critique, which a step that may spill leaves to the next
            judge = max(judge, _one_critique(speeds.judge, work.judge_longest) + (0.0 if g else rollout))
    need = work.train_tokens / speeds.train_per_s
    if ready_first and t:
        return max(judge, need / t)
    # Early train ranks can only work through groups already judged: in a long tail most groups
    # complete near the end, so counting on those still to come would park ranks in train idle.
    left = need - min(need, t * judge, work.train_ready / speeds.train_per_s)
    if work.update_early and not left:  # the train ranks are through (or were) before the last critique
        return judge
    to_train = costs[(Role.JUDGE, Role.TRAIN)] * (n - t)
    if 0 < t < n:  # an early train group is made anew at the update, with every rank: a reshard all wait for
        to_train += costs.get((Role.TRAIN, Role.TRAIN), 0.0) * n
    return judge + (left + to_train) / n


def update_seconds(left_s: float, roles: list[str], costs: dict[tuple[str, str], float]) -> tuple[float, bool]:
    """Once the step's rounds are over and the update is still to make: how long its rest takes (`left_s`:
    its training's seconds on one rank), and whether the ranks in train (of `roles`) make it alone, holding
    what they trained early, which they do where that is no slower than every rank making it: the others
    shift into train while an early train group is made anew with every rank (a reshard), all at once
    (a collective: the dearest of those shifts), then every rank shares the training (book.update_roles
    acts on the answer). `costs[(a, b)]`: a shift from a to b, into a train group of every rank."""
    train, ranks = roles.count(Role.TRAIN), len(roles)
    moves = [costs[(role, Role.TRAIN)] for role in roles]  # a train rank's own: the reshard
    everyone = (max(moves) if train < ranks else 0.0) + left_s / ranks
    if train and left_s / train <= everyone:
        return left_s / train, True
    return everyone, False


def _slowed(speed: EngineSpeed, factor: float) -> EngineSpeed:
    return replace(speed, step_s=speed.step_s * factor, per_seq_s=speed.per_seq_s * factor,
                   prefill_per_s=speed.prefill_per_s / factor)


def engine_seconds(speed: EngineSpeed, k: int, seqs: int, tokens: float, longest: float, prefill: float) -> float:
    """Seconds for k engines to finish `seqs` sequences that still hold `tokens` decode tokens, the
    longest `longest`, balanced over the engines: one engine step per token of the longest (more while
    the queue overfills the engines), each step the fixed read plus its running sequences."""
    if seqs == 0:
        return 0.0
    if k == 0:
        return math.inf
    steps = max(longest, tokens / (k * speed.max_seqs))
    return steps * speed.step_s + speed.per_seq_s * tokens / k + prefill / (k * speed.prefill_per_s)


def _one_critique(speed: EngineSpeed, tokens: float) -> float:
    return engine_seconds(speed, 1, 1, tokens, tokens, 0.0) if tokens else 0.0


def _judge_work(work: Work) -> tuple[int, float, float]:
    """The judge's sequences, critique tokens and prefill tokens: those waiting and those to come."""
    return (work.judge_seqs + work.rollout_seqs,
            work.judge_tokens + work.rollout_seqs * work.critique_tokens,
            work.judge_prefill + work.rollout_seqs * work.judge_prompt_tokens)


def _judge_waiting(work: Work) -> int:
    """Responses waiting for a judge engine (not yet admitted), from their prefill tokens."""
    if not work.judge_prefill or not work.judge_seqs:
        return 0
    if not work.judge_prompt_tokens:
        return 1
    return max(1, round(min(float(work.judge_seqs), work.judge_prefill / work.judge_prompt_tokens)))


def _has_work(role: str, work: Work) -> bool:
    """Work the role can do now (judge work to come does not count: rollout ranks take it later). The
    train role has some only where the update's groups are an earlier step's (`update_early`): the
    sooner its ranks are through them, the sooner the update is published and the next step begins
    (book.publish_due), a gain beyond this step that finish_seconds does not count."""
    return {Role.ROLLOUT: work.rollout_seqs > 0, Role.JUDGE: work.judge_seqs > 0,
            Role.TRAIN: work.update_early and work.train_ready > 0}[role]


def _starved(ranks: list[Rank], work: Work) -> list[str]:
    """Roles with work now and no rank, in the order they get one: the judge last, since its responses
    can wait for the rollout ranks, which join it as rollout ends."""
    held = {r.role for r in ranks}
    return [role for role in (Role.ROLLOUT, Role.TRAIN, Role.JUDGE) if _has_work(role, work) and role not in held]


def _give_ranks(ranks: list[Rank], work: Work, role: str, n: int, rollout_room: int) -> list[Move]:
    """`n` ranks for a role that has none: from a role with nothing to do now if there is one, else from
    the role with the most ranks (keeping one); the ranks with the fewest tokens in flight, then the
    lowest indices. Where every role holding ranks has work and none can spare one, the judge and train
    get none: the judge's responses wait for the rollout ranks, which join it as rollout ends, and the
    update's groups for every rank to train them at the step's end; rollout gets one from train. Rollout
    cannot spare ranks whose sequences the rollout ranks left could not run at once (`_overflows`, with
    engines of `rollout_room` sequences)."""
    counts = _counts(ranks)

    def by_load(roles) -> list[int]:
        return sorted((i for i, r in enumerate(ranks) if r.role in roles), key=lambda i: (ranks[i].in_flight_tokens, i))

    idle = [r for r in ROLES if counts[r] and not _has_work(r, work)]
    most = max((r for r in ROLES if counts[r] > 1), key=lambda r: counts[r], default=None)
    free = by_load(idle) if idle else by_load([most])[:counts[most] - 1] if most else []
    if _overflows(work, [ranks[i] for i in free[:n]], counts[Role.ROLLOUT] - n, rollout_room):
        free = []
    if len(free) < n:
        if role != Role.ROLLOUT:
            return []
        if not counts[Role.TRAIN]:
            raise ValueError(f"{len(ranks)} rank(s) cannot serve every role with work at once")
        free = by_load([Role.TRAIN])
    return [Move(i, ranks[i].role, role) for i in free[:n]]


def _best_move(ranks, work, speeds, costs, config) -> tuple[list[int], str] | None:
    """The ranks and destination of the move that pays best, or None. Moves of 1, 2, 4, ... ranks are
    weighed: in a long tail no single rank's move may pay while freeing half the rollout ranks does."""
    counts = _counts(ranks)
    now = finish_seconds(work, _working(ranks, work), speeds, costs, config.early_train)
    best, best_net = None, 0.0
    for src in ROLES:
        for dst in _destinations(src, work, config):
            movable = sorted((i for i, r in enumerate(ranks)
                              if r.role == src and r.since_shift_s >= config.dwell * costs[(src, dst)]),
                             key=lambda i: (ranks[i].in_flight_tokens, i))
            keep = 1 if _has_work(src, work) else 0
            m = 1
            while m <= min(len(movable), counts[src] - keep):
                net = _net_gain(ranks, movable[:m], src, dst, work, counts, now, speeds, costs, config)
                if net > best_net:
                    best, best_net = (movable[:m], dst), net
                m *= 2
    return best


def _destinations(src: str, work: Work, config: PlannerConfig) -> list[str]:
    """Where a rank may go: to a role with work for it on arrival. Rollout only while sequences wait
    for a rollout engine (an arriving rank is handed queued work, never a share of what runs
    elsewhere), the judge only with responses to judge (one sent ahead of them would idle until they
    come), train only with judged groups."""
    dsts = ([Role.ROLLOUT] if work.rollout_prefill > 0 else []) + ([Role.JUDGE] if work.judge_seqs else []) + \
        ([Role.TRAIN] if config.early_train and work.train_ready > 0 else [])
    return [d for d in dsts if d != src]


def _net_gain(ranks, moving, src, dst, work, counts, now, speeds, costs, config) -> float:
    """Seconds a move saves beyond (1 + margin) x its cost; positive when it pays."""
    after = _working([replace(r, role=dst, in_flight_tokens=0) if i in moving else r for i, r in enumerate(ranks)],
                     work)
    if 0 < after[Role.TRAIN] < config.min_train_ranks:  # a train group too small to hold the training state
        return -math.inf
    migrated = sum(ranks[i].in_flight_tokens for i in moving)
    if migrated and not after[src]:
        return -math.inf  # its sequences would have no rank left to resume on
    if _overflows(work, [ranks[i] for i in moving], after[Role.ROLLOUT], speeds.rollout.max_seqs):
        return -math.inf
    saved = now - finish_seconds(work, after, speeds, costs, config.early_train)  # once the rules allow the move
    prefill = 0.0
    if migrated:
        speed = speeds.rollout if src == Role.ROLLOUT else speeds.judge
        prefill = migrated / (speed.prefill_per_s * after[src])
    # A move into or out of a train group that holds the state saves it, and every rank waits for that.
    regroup = costs.get((Role.TRAIN, Role.TRAIN), 0.0) if Role.TRAIN in (src, dst) and counts[Role.TRAIN] else 0.0
    return saved - (1 + config.margin) * (costs[(src, dst)] + prefill + regroup)


def _overflows(work: Work, leaving: list[Rank], rollout_ranks: int, max_seqs: int) -> bool:
    """Whether the ranks `leaving` take rollout sequences with them (rollout ranks with some in flight)
    that, none of rollout's prompts waiting, would no longer fit the engines of the `rollout_ranks` left.
    Those beyond the engines' room wait at rank 0 and are handed out only at a round's start, as others
    finish, where `engine_seconds` counts them started as soon as room frees; no move makes such a queue,
    whether it pays in that model (`_net_gain`) or gives a role with work its first rank (`_give_ranks`).
    This machine's task (bench/results/placements-task.json at 1250721, ranks of 64 sequences): in step 5
    of each of the five pivot@0 repeats, 0.08 s in, a response had finished and the judge had no rank, so
    one of the two rollout ranks went to it with 63-64 sequences in flight on each; the migrated ones
    waited for rounds on the other, and the step took 0.12-0.31 s (10-26%) longer than colocated@0's in
    four of the five. Where the step may end with groups still out (`work.spill`), a sequence that waits a
    round holds no update, and the rule is left out: with it the simulator's H200 preset at K = 2 moved by
    up to 6% a seed either way, its means by under 1%."""
    return (any(r.role == Role.ROLLOUT and r.in_flight_tokens for r in leaving) and not work.spill
            and not work.rollout_prefill and work.rollout_seqs > rollout_ranks * max_seqs)


def _working(ranks: list[Rank], work: Work) -> dict[str, int]:
    """Ranks per role as finish_seconds counts them: an engine rank with nothing running, beside ranks of
    its role that do run its last sequences, while nothing is queued for the role or still to come
    (rollout: no prompt waiting; the judge: no response waiting and none still rolling out), can add
    nothing to it, so it counts apart, as `idle` (in the judge's tail such a rank would otherwise seem
    to share the critiques the busy ranks still write, and moving it seem to slow them)."""
    counts = _counts(ranks)
    counts["idle"] = 0
    for role in ENGINE_ROLES:
        busy = sum(r.role == role and r.in_flight_tokens > 0 for r in ranks)
        if busy and not _can_get_work(role, work):
            counts["idle"] += counts[role] - busy
            counts[role] = busy
    return counts


def _can_get_work(role: str, work: Work) -> bool:
    if role == Role.ROLLOUT:
        return work.rollout_prefill > 0
    return work.judge_prefill > 0 or work.rollout_seqs > 0


def _counts(ranks: list[Rank]) -> dict[str, int]:
    return {role: sum(r.role == role for r in ranks) for role in ROLES}


class LinearFit:
    """Online least-squares fit of seconds = fixed + per_unit x units from measured (units, seconds),
    each measurement weighing `decay` times the next one (an EWMA of the sums), so the fit follows a
    drifting speed. The prior enters as two measurements, at units `lo` and `hi`, that never decay: the
    fit is defined before the first measurement and while every measurement has the same units."""

    def __init__(self, fixed: float, per_unit: float, *, lo: float = 1.0, hi: float = 64.0,
                 decay: float = 0.9, prior_weight: float = 0.01):
        self.decay = decay
        self.prior = _sums([(lo, fixed + per_unit * lo), (hi, fixed + per_unit * hi)], prior_weight)
        self.sums = (0.0,) * 5

    def observe(self, units: float, seconds: float) -> None:
        self.sums = tuple(s * self.decay + d for s, d in zip(self.sums, _sums([(units, seconds)], 1.0)))

    def fit(self) -> tuple[float, float]:
        """(fixed, per_unit), neither below zero (a noisy fit could make one so); where every measurement and
        the prior have the same units (an engine of one sequence), their mean seconds and none per unit."""
        w, x, y, xx, xy = (a + b for a, b in zip(self.sums, self.prior))
        spread = w * xx - x * x
        per_unit = max(0.0, (w * xy - x * y) / spread) if spread > 0 else 0.0
        return max(0.0, (y - per_unit * x) / w), per_unit


def _sums(points: list[tuple[float, float]], weight: float) -> tuple[float, ...]:
    return (weight * len(points), weight * sum(x for x, _ in points), weight * sum(y for _, y in points),
            weight * sum(x * x for x, _ in points), weight * sum(x * y for x, y in points))


class TrainSpeed:
    """The training speed: prompt and response tokens per second per train rank through forward and
    backward, what early training's share of ranks is sized by. One estimate per run, kept across steps
    (and in the planner's state across a resume): each measurement, an update's or an early train
    round's, moves it halfway from where it stood."""

    PRIOR = 2e3  # about what the built-in task's models train at on CPU, before anything is measured

    def __init__(self, per_s: float = PRIOR):
        self.per_s = per_s

    def observe(self, per_s: float) -> None:
        """A measured speed, in the estimate's units."""
        self.per_s = 0.5 * self.per_s + 0.5 * per_s


class LengthEstimate:
    """How many tokens a sequence that has generated g still has to go, from lengths seen (say, the
    previous step's responses): the mean excess of those longer than g, or the budget's rest when none
    seen was longer (it can still run to the budget). Takes one g or an array of them."""

    def __init__(self, lengths, budget: int):
        self.lengths, self.budget = np.sort(np.asarray(lengths, dtype=np.float64)), budget
        self.suffix = np.append(np.cumsum(self.lengths[::-1])[::-1], 0.0)  # suffix[i]: sum of lengths[i:]

    def remaining(self, g):
        g = np.asarray(g, dtype=np.float64)
        i = np.searchsorted(self.lengths, g, side="right")
        longer = len(self.lengths) - i
        rest = np.where(longer > 0, self.suffix[i] / np.maximum(longer, 1) - g, self.budget - g)
        return float(rest) if rest.ndim == 0 else rest

    def longest(self, g: float, share: float = 1.0) -> float:
        """The rest of the longest sequence still running when the least advanced has generated g; with
        `share` < 1, of the one at that share of the lengths seen (none once the least advanced is past it)."""
        if share < 1 and len(self.lengths):
            return float(max(0.0, self.lengths[math.ceil(share * len(self.lengths)) - 1] - g))
        return float((self.lengths[-1] if len(self.lengths) and self.lengths[-1] > g else self.budget) - g)

    def mean(self) -> float:
        return float(self.lengths.mean()) if len(self.lengths) else float(self.budget)


def first_empty_seconds(speed: EngineSpeed, running: list[list[int]], lengths: LengthEstimate, ranks: int) -> float | None:
    """Seconds until enough engines run empty to end a round early (book.empty_enough of `ranks`), of those
    that get no more work and run `running` (each one's list of its sequences' tokens generated so far),
    each as engine_seconds has it with what `lengths` expects them to have left; None where too few run."""
    ends = sorted(engine_seconds(speed, 1, len(g), float(rest.sum()), float(rest.max()), 0.0)
                  for g in running if g for rest in [lengths.remaining(g)])
    enough = book.empty_enough(ranks)
    return ends[enough - 1] if len(ends) >= enough else None


def parse_split(text: str, world_size: int, slot_size: int = 1) -> list[str]:
    """--split rollout=2,judge=1,train=1 -> each slot's role, in blocks (rollout slots first), for a world of
    `world_size` slots of `slot_size` ranks (--engine-tp; 1: a slot is a rank)."""
    counts = {}
    for part in text.split(","):
        role, _, n = part.partition("=")
        role = role.strip()
        if role not in ROLES:
            raise ValueError(f"--split {text}: unknown role {role!r}; use {', '.join(ROLES)} as ROLE=RANKS")
        if not n.strip().isdigit():
            raise ValueError(f"--split {text}: {part!r} needs a whole number of ranks, e.g. {role}=1")
        counts[role] = counts.get(role, 0) + int(n)
    for role in (Role.ROLLOUT, Role.JUDGE):
        if counts.get(role, 0) < 1:
            raise ValueError(f"--split {text}: {role} needs at least one rank, e.g. add {role}=1")
    total = sum(counts.values())
    if total != world_size:
        change = f"add {world_size - total}" if total < world_size else f"remove {total - world_size}"
        if slot_size > 1:
            raise ValueError(f"--split {text} places {total} slot(s) of --engine-tp {slot_size} ranks but the world "
                             f"has {world_size}: {change} slot(s) in --split, or launch with --nproc_per_node x "
                             f"--nnodes = {total * slot_size}")
        raise ValueError(f"--split {text} places {total} rank(s) but the world has {world_size}: {change} "
                         f"rank(s) in --split, or launch with --nproc_per_node x --nnodes = {total}")
    return [role for role in ROLES for _ in range(counts.get(role, 0))]


class LoopPlanner:
    """A pivot run's roles each round, (roles, queues, rng) -> roles (Placement.next_roles calls it), over
    `plan`. It keeps what the planner needs across rounds: a fit of each engine's step time, measured by
    the ranks, each rank's seconds since its last shift, counted in the rounds' seconds as rank 0 saw them
    (no clock here), the training speed (`train`), which the loop's measurements of it update, and how
    much slower the engines step while a rank trains beside them (`beside_train`, Speeds': the decode
    steps of each round in which a rank trained against the fit of the others, halfway from where it
    stood each such round), and each engine role's prefill speed (`prefill_per_s`).
    `speeds` are the priors.

    It reads from shifting.scheduler.StepQueues: `queued("rollout")` and `queued("judge")` (Requests:
    prompt_ids, generated, max_tokens), `prompts`, `update_book.train_work()` (the update's tokens left:
    shifting/book.py Book), `train_pool` (None unless the update trains an earlier step's samples), `early_train`
    (whether its rounds hand judged groups to train ranks), `round_s` (the last
    round's seconds), `timed_round()` (the next round's, whose intake the planner weighs) and `reports`, the last
    round's Report of every rank, in rank order, of which it reads `generated` (tokens each in-flight
    request has generated), `in_flight_tokens` (prompt + generated tokens of those requests),
    `engine_steps` (the round's engine steps as (sequences, seconds, prefill tokens)) and `train_s` (its
    seconds of training in the round).
    """

    def __init__(self, speeds: Speeds, costs: dict[tuple[str, str], float], lengths: LengthEstimate,
                 critiques: LengthEstimate, config: PlannerConfig = PlannerConfig()):
        self.speeds, self.costs, self.config = speeds, costs, config
        self.lengths, self.critiques = lengths, critiques
        self.fits = {role: LinearFit(s.step_s, s.per_seq_s, hi=s.max_seqs)
                     for role, s in ((Role.ROLLOUT, speeds.rollout), (Role.JUDGE, speeds.judge))}
        self.train = TrainSpeed(speeds.train_per_s)
        self.beside_train = speeds.beside_train
        self.since: list[float] | None = None
        # The judge template's tokens around a prompt and its response: what of a judge prompt is neither,
        # as the last round's responses and their judge requests show it (none before the first).
        self.judge_template = 0.0
        # Each engine role's prefill: tokens, and the seconds its engine steps took beyond their decode fit
        # (`prefill_per_s`)
        self.prefill = {role: [0.0, 0.0] for role in self.fits}

    def __call__(self, roles: list[str], queues, rng=None) -> list[str]:
        reports = queues.reports
        templates = [len(judging.prompt_ids) - len(sample.prompt_ids) - len(sample.response_ids)
                     for r in reports for sample, judging in r.responses]
        if templates:
            self.judge_template = sum(templates) / len(templates)
        if self.since is None:
            self.since = [math.inf] * len(roles)
        self.since = [s + queues.round_s for s in self.since]
        beside = any(r.train_s for r in reports)  # a rank trained this round: the engines stepped beside it
        fits = {role: fit.fit() for role, fit in self.fits.items()}
        measured = expected = 0.0
        for r in reports:
            for batch, seconds, prefill in r.engine_steps:
                if r.role not in self.fits:
                    continue
                if prefill:  # a step that prefilled: its seconds beyond the decode fit are the prefill's
                    fixed, per_seq = fits[r.role]
                    if not beside and seconds > fixed + per_seq * batch:
                        sums = self.prefill[r.role]
                        sums[0], sums[1] = sums[0] + prefill, sums[1] + seconds - fixed - per_seq * batch
                    continue
                if beside:
                    fixed, per_seq = fits[r.role]
                    measured, expected = measured + seconds, expected + fixed + per_seq * batch
                else:
                    self.fits[r.role].observe(batch, seconds)
        if expected > 0:
            self.beside_train = 0.5 * self.beside_train + 0.5 * measured / expected
        ranks = [Rank(role, rep.in_flight_tokens, since) for role, rep, since in zip(roles, reports, self.since)]
        seqs = {role: len(queues.queued(role)) + sum(len(rep.generated) for rep in reports if rep.role == role)
                for role in self.fits}
        speeds = self.measured_speeds(seqs, len(roles), queues.timed_round().seconds)
        moves = plan(ranks, self.work(queues), speeds, self.costs, self.config)
        for move in moves:
            self.since[move.rank] = 0.0
        return apply_moves(roles, moves)

    def state(self) -> dict:
        """What it has learned, as JSON: engine-step fits, shift costs, lengths seen, dwell clocks, the
        training speed, the engines' slowdown beside training, the judge template's tokens, each engine role's
        prefill (`prefill_per_s`)."""
        return {"fits": {role: list(fit.sums) for role, fit in self.fits.items()},
                "costs": [[a, b, cost] for (a, b), cost in self.costs.items()],
                "lengths": self.lengths.lengths.tolist(), "critiques": self.critiques.lengths.tolist(),
                "since": self.since, "train_per_s": self.train.per_s, "beside_train": self.beside_train,
                "judge_template": self.judge_template, "prefill": self.prefill}

    def load_state(self, state: dict) -> None:
        for role, sums in state["fits"].items():
            self.fits[role].sums = tuple(sums)
        self.costs = {(a, b): cost for a, b, cost in state["costs"]}
        self.lengths = LengthEstimate(state["lengths"], self.lengths.budget)
        self.critiques = LengthEstimate(state["critiques"], self.critiques.budget)
        self.since = state["since"]
        self.train.per_s = state["train_per_s"]  # in place: the loop's Placement holds this same estimate
        self.beside_train = state.get("beside_train", 1.0)  # a checkpoint from before it was measured: 1
        self.judge_template = state.get("judge_template", 0.0)  # ... or before it was kept: none seen
        self.prefill = state.get("prefill", self.prefill)  # ... or before prefill was measured: none yet

    def prefill_per_s(self, role: str) -> float:
        """An engine role's prefill tokens per second, as its engine steps that prefilled measure it beyond
        their decode fit (not beside training); the prior before any."""
        tokens, seconds = self.prefill[role]
        return tokens / seconds if seconds > 0 else getattr(self.speeds, role).prefill_per_s

    def capacity(self, role: str, seqs: int, ranks: int, round_s: float | None) -> int:
        """The most sequences one engine of `role` takes in for a round of `round_s` seconds (book.intake),
        from the fit of its steps and the critiques' mean length, given the role's `seqs` queued and running
        over `ranks` ranks."""
        return self._intake(role, seqs, ranks, round_s, *self.fits[role].fit())

    def _intake(self, role: str, seqs: int, ranks: int, round_s: float | None, step_s: float, per_seq_s: float) -> int:
        return book.intake(role, step_s, per_seq_s, getattr(self.speeds, role).max_seqs, seqs, ranks, round_s,
                           self.critiques.mean())

    def first_empty(self, running: list[list[int]], ranks: int) -> float | None:
        """first_empty_seconds of rollout engines running `running`, at the fit of their steps."""
        step_s, per_seq_s = self.fits[Role.ROLLOUT].fit()
        speed = replace(self.speeds.rollout, step_s=step_s, per_seq_s=per_seq_s)
        return first_empty_seconds(speed, running, self.lengths, ranks)

    def measured_speeds(self, seqs: dict[str, int] | None = None, ranks: int = 1,
                        round_s: float | None = None) -> Speeds:
        """The engines' fitted speeds and measured prefill speeds (`prefill_per_s`); given each role's `seqs`
        queued and running over `ranks` ranks, an engine's room is what it takes in for the next round, of
        `round_s` seconds (`capacity`), as the planner then weighs the roles."""
        engines = {}
        for role, fit in self.fits.items():
            prior, (step_s, per_seq_s) = getattr(self.speeds, role), fit.fit()
            room = prior.max_seqs if seqs is None else self._intake(role, seqs[role], ranks, round_s, step_s, per_seq_s)
            engines[role] = replace(prior, step_s=step_s, per_seq_s=per_seq_s, max_seqs=room,
                                    prefill_per_s=self.prefill_per_s(role))
        return replace(self.speeds, train_per_s=self.train.per_s, beside_train=self.beside_train, **engines)

    def work(self, queues) -> Work:
        running = [(rep.role, g) for rep in queues.reports for g in rep.generated]
        rolling = ([g for role, g in running if role == Role.ROLLOUT]
                   + [len(r.generated) for r in queues.queued(Role.ROLLOUT)])
        prompt = sum(len(p["prompt_ids"]) for p in queues.prompts) / len(queues.prompts)
        # Groups trained early already are no longer work; with --max-staleness > 0 the update's groups are
        # an earlier step's, all judged, and this step's responses still to come are not its work.
        ready, generated, coming = queues.update_book.train_work()
        return step_work(
            rolling=rolling, judging=[g for role, g in running if role == Role.JUDGE],
            rollout_prefill=sum(len(r.prompt_ids) + len(r.generated) for r in queues.queued(Role.ROLLOUT)),
            judge_waiting=len(queues.queued(Role.JUDGE)),
            judge_prefill=sum(len(r.prompt_ids) for r in queues.queued(Role.JUDGE)),
            prompt_tokens=prompt, judge_template_tokens=self.judge_template, train_ready=ready,
            train_generated=generated, train_coming=coming, early_train=queues.early_train,
            update_early=queues.train_pool is not None, lengths=self.lengths, critiques=self.critiques,
            spill=queues.spill, group_size=queues.group_size)


def step_work(*, rolling: list[int], judging: list[int], rollout_prefill: float, judge_waiting: int,
              judge_prefill: float, prompt_tokens: float, judge_template_tokens: float, train_ready: float,
              train_generated: float, train_coming: int, early_train: bool, update_early: bool,
              lengths: LengthEstimate, critiques: LengthEstimate, spill: bool, group_size: int) -> Work:
    """What is left of a step, as the planner weighs it, from what rank 0 knows of it (the loop's
    LoopPlanner.work and the simulator both build it here): `rolling`, the tokens generated so far by
    every response not finished (queued or running; a migrated one has some), `judging`, those of every
    critique being written, `judge_waiting` responses queued for the judge, the prefill tokens queued for
    each engine role, a prompt's tokens and the judge template's around it and its response, the update's
    tokens judged and ready now, those generated and not trained yet, and its samples still to come
    (book.Book.train_work). A response still to come is priced at the expected length (neither side knows
    one before it is generated): its sample at the prompt and the response, its judge prompt at those and
    the template. Whether the step's rounds hand judged groups to train ranks at all
    (`early_train`: none are ready for them otherwise, as in a step rolled out before the first update),
    whether the update's groups are an earlier step's (`update_early`) and whether the step may end with
    groups still out (`spill`), and then with its longest responses still rolling out: the rollout's tail
    is the response at the share of them that leaves no more groups of `group_size` out than the step may
    (book.bulk_share). `lengths` and `critiques` estimate what each sequence has left."""
    response = lengths.mean()
    bulk = book.bulk_share(group_size) if spill else 1.0
    return Work(
        rollout_seqs=len(rolling),
        rollout_tokens=float(lengths.remaining(rolling).sum()) if rolling else 0.0,
        rollout_longest=lengths.longest(min(rolling), bulk) if rolling else 0.0,
        rollout_prefill=float(rollout_prefill),
        judge_seqs=judge_waiting + len(judging),
        judge_tokens=(float(critiques.remaining(judging).sum()) if judging else 0.0) + judge_waiting * critiques.mean(),
        # a response still waiting for the judge has its whole critique to write
        judge_longest=critiques.longest(0 if judge_waiting else min(judging)) if judging or judge_waiting else 0.0,
        judge_prefill=float(judge_prefill),
        critique_tokens=critiques.mean(),
        judge_prompt_tokens=prompt_tokens + judge_template_tokens + response,
        train_ready=train_ready if early_train else 0.0,
        train_tokens=train_generated + train_coming * (prompt_tokens + response),
        update_early=update_early,
        spill=spill,
    )
