"""Discrete-event simulation of GRPO steps with a judge on N slots, in three placements:

  colocated      every slot rolls out, then every slot judges, then every slot trains
  disaggregated  a fixed split of slots per role, sized to each role's share of the step's work;
                 responses stream to the judge; the train slots train the whole step at its end
  pivot          rank 0 runs planner.py at every round and moves slots between roles; a slot leaving
                 an engine role exports its running sequences, which go back to the head of their
                 queue at the next exchange and resume elsewhere after prefilling prompt + generated;
                 train slots train judged groups while the step runs (early training)
Each step of every placement ends the same way: the rest of its update runs (colocated and pivot: on
every slot), the new policy is published to storage, and the rollout engines load it. With
--max-staleness K > 0 the update is an earlier step's (pipeline.py), whose groups are all judged when
the step starts: disaggregated's train slots, and pivot's where the planner sends them, work through
them while the step rolls out and judges; once through they make the update, it is published at the
round after, and the next step begins beside this one's tail (book.Book.extend and carry, the book the
loop's StepQueues keeps too), by the same rules (shifting/book.py update_due, publish_due, ahead_step).
Under --updates ready (the loop's default; RoundRules.updates) at K >= 2 the pipeline is K - 1 deep and a
step ends once the next step has begun, every group carried in from the step before is judged and at most
half of its own groups are still out; those go on in the next step and train with it (book.Book.may_end,
spill); under --updates step every step ends with all its groups judged.

The slots work in rounds, as pivot_train.py's ranks do (shifting/scheduler.py `generate`). A round
starts with orders from rank 0: every slot's role (a train group that changes is made anew,
collectively: its state is resharded, with any gradients accumulated early, and every slot waits for
the longest shift; a shift between engine roles holds the shifting slot alone), the
queued work that fits each engine, shared fairly in slot order, and for pivot's train slots every
judged group no train slot has had. Each engine then
steps at its own pace, its new requests first, in chunks of at most `prefill_chunk_tokens` a step
(vLLM's chunked prefill), with a batch fixed between two events, so the next event is the next
sequence to finish. An engine stops for the round when it runs empty, or at its first step boundary
after the round's limit: none when colocated has nothing queued (its phase ends when its last engine
empties), else `round_steps` times the median engine step seen in the step (and at least
`over_exchange` exchanges and `over_longest` of the longest recent steps), which slots that run empty
after stepping (one in `empty_share`, one at least) cut short for every slot (the loop's RoundEnd
counter in the launch's store, seen `notice_s` later). A slot past the limit with work in
hand steps on until every slot has reached it; the train slots likewise, group by group (they reach it
at the end of the group in progress, and stop there if they are the last), and hand back the groups
they did not reach. A slot that has stopped waits for the others: the round ends with the last
step or group in progress. Then the round's exchange with
rank 0 costs what the cost model says, and only then does rank 0 learn what finished: responses join
the judge's queue, judged groups become trainable.

Where the cost model says so (CpuModel), slots share `cores` cores: each works max(1, busy / cores) times
slower while `busy` slots work, so any change in how many work re-times every engine, each keeping
the fraction of the step it is into.
"""
import heapq
import math
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

import pipeline
import planner
from roles import ENGINE_ROLES, ROLES, Role
from shifting import book
from sim.calibration import CostModel, Workload

# A slot at work in its role; idle in it (nothing to do: an engine run empty, a trainer through its
# groups); waiting for other slots with work in hand (an engine past the round's limit, which holds
# sequences, while another slot finishes a step or a group; everyone not moving in a collective
# shift); shifting; in the exchange with rank 0.
STATES = ROLES + tuple(f"{r} idle" for r in ROLES) + ("waiting", "shifting", "exchange")


@dataclass(frozen=True)
class RoundRules:
    """How pivot_train.py sizes and ends a round and a step: the scheduling book's figures (shifting/book.py:
    the --round-steps default, how soon a round's end is seen, ROUND_OVER_EXCHANGE, ROUND_OVER_LONGEST,
    EMPTY_SHARE and the engine step's seconds before any is measured) and the loop's --updates, which
    what-if runs (bench/sim_whatif.py) may change, six switches that turn its rules off, and three that add
    rules it lacks:
      updates             --updates (pipeline.UPDATES): "ready", the loop's default, runs the pipeline at
                          K - 1 at --max-staleness K >= 2 (pipeline.depth), and ends a step's rounds once the
                          next step has begun, every group carried in from the step before is judged and at
                          most book.SPILL_SHARE of its own groups are still out (book.Book.may_end); those go
                          on in the next step (Book.spill, Book.carry) and train with it, an update later, K
                          updates after the weights that began them, the rest K - 1. The bound per group, as
                          the paper's release keeps it in its staleness buffers (victor-yfzhao/psrl
                          pivotrl/workers/ps/staleness_controller.py: a sample begun under version v may enter
                          the buffers of updates v to v + K). "step": step-locked, the pipeline K deep, every
                          step's rounds running until all its groups are judged. At K = 0 and 1 the two are one
      step_on             a slot that reaches the round's limit with work in hand keeps stepping until
                          every slot has reached it (off: it stops and waits for the round's end)
      shifts_stall_all    every shift holds every slot until the longest one is done (the loop holds
                          them all only where the train group changes; a shift between engine roles
                          holds the shifting slot alone, which takes work again at the next round)
      migrate_at_once     the running sequences of a slot that leaves an engine role go back to rank 0 as
                          the round begins (one more exchange, before any shift) and on in that round, on the
                          slots of their role (scheduler.py's Orders.migrate, as the loop does; off: they
                          are queued at the next exchange)
      trained_through     train slots through every group handed to them in a round that ranks run empty
                          end early count as run empty (scheduler.py, as the loop's train ranks do; off:
                          they wait for the round's end)
      intake              pivot's judge engines take in only as many responses as they step well
                          (book.intake, as the loop's do; off: up to their room)
      prefill_budget      at K = 0 pivot's judge engines take new work in a timed round only as far as they
                          prefill it in the round (book.prefill_budget, as the loop's do; off: up to their
                          intake)
      prefill_intake      the roles whose engines, under pivot, take new work in a timed round only as far
                          as they prefill it in the round (one request at least) at any K; the rest waits at
                          rank 0, where the planner sees it and a slot that joins the role can take it
                          (none: the loop's prefill_budget alone)
      deep_pipeline       with updates "step" at --max-staleness K > 0, an update waits for its own step
                          alone: each update's rounds end once the next update's step is judged, while the
                          K - 1 after it roll on, and step s begins as soon as weights s - K are published, so
                          K + 1 steps are in flight at most (off, as the loop does: each update's rounds roll
                          step u + K out to its end, and one step begins ahead of it; pipeline.py)
      carry_running       as a step ends, the engines go on with the next steps' sequences where they are,
                          renumbered in the next step's book (off, as the loop does: they export them, and
                          the next step queues them first and prefills each again where it lands)
      rollout_hold        pivot's rollout engines hold up to this many times their room (max_seqs), stepping
                          their room at once and starting the others as those finish, as vLLM's scheduler
                          queues what is beyond its max_num_seqs (1, as the loop does: their room)"""
    round_steps: int = book.ROUND_STEPS
    notice_s: float = book.NOTICE_S
    first_engine_step_s: float = book.FIRST_ENGINE_STEP_S
    over_exchange: float = book.ROUND_OVER_EXCHANGE
    over_longest: float = book.ROUND_OVER_LONGEST
    empty_share: float = book.EMPTY_SHARE
    step_on: bool = True
    shifts_stall_all: bool = False
    migrate_at_once: bool = True
    trained_through: bool = True
    prefill_intake: tuple[str, ...] = ()
    intake: bool = True
    prefill_budget: bool = True
    deep_pipeline: bool = False
    carry_running: bool = False
    rollout_hold: float = 1.0
    updates: str = "ready"

    def __post_init__(self):
        if self.updates not in pipeline.UPDATES:
            raise ValueError(f"RoundRules: updates {self.updates!r}: one of {', '.join(pipeline.UPDATES)}")


@dataclass(frozen=True)
class Round:
    seconds: float | None  # None: every engine works until it runs empty
    early: bool  # a slot that runs empty after stepping ends the round for every slot


@dataclass
class Slot:
    index: int
    role: str
    running: list[int] = field(default_factory=list)  # samples in its engine
    finished: list[int] = field(default_factory=list)  # finished this round: rank 0 hears at its end
    exported: list[int] = field(default_factory=list)  # handed back by a shift: queued at once (migrate_at_once)
    t: float = 0.0  # the end of its engine's last whole step
    step_s: float = 0.0  # seconds per engine step until its batch or the cores' sharing changes
    prefill_s: float = 0.0  # prefill its engine has still to do before it decodes again (uncontended seconds)
    # its round's prefill chunks as _prefill set them: (first chunk's start, a chunk's seconds, the cores' share,
    # the last chunk's end), which a round that ends sooner cuts (_end_round)
    chunks: tuple[float, float, float, float] | None = None
    halt: float = math.inf  # this round it starts no engine step after this
    stopped: bool = True  # done with this round: waiting for the others
    arrived: bool = True  # has reached the round's end on its own (its limit; or it ran empty, or had no work)
    stepped: bool = False  # took an engine step this round
    ready_at: float = 0.0  # a shift in progress ends then
    shifted_at: float = -math.inf
    version: int = 0  # events scheduled under an older version are stale


@dataclass
class Result:
    placement: str
    slots: int
    seconds: float
    samples: int  # a step's draw per timed update: the updates' pace (Simulation.run)
    trained_samples: int  # those of the groups the timed updates trained (under --updates ready, more or fewer)
    tokens: int
    shifts: int
    shift_seconds: float
    step_seconds: list[float]  # each timed RL step's (an update's) seconds
    split: dict[str, int]
    slot_seconds: dict[str, float]  # by state (STATES); sums to slots x seconds
    phases: dict[str, float]  # summed over steps: until the last response, then the last verdict, then the end
    critical_path_s: float  # summed over steps: the slowest sample's chain (Simulation._critical_path)
    rounds: int  # rounds in which a slot worked, as pivot_train.py counts them
    bound_s: float  # summed over steps: what no placement can beat at this K (Simulation.run)
    work_bound_s: float  # summed over steps: the work at the best rate per slot (Simulation._work_bound)
    trained: list[tuple[int, int, int]]  # every update of the run, timed or not: (update, step trained, its version)
    spans: list[dict] | None = None  # with Simulation.spans kept (--timeline): every slot's, the whole run's

    @property
    def busy_fraction(self) -> float:
        """Of all slot-seconds, those spent at work (an engine with sequences, a trainer with tokens):
        the rest is what moving slots between roles can fill."""
        return sum(self.slot_seconds.get(role, 0.0) for role in ROLES) / (self.slots * self.seconds)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds

    @property
    def trained_samples_per_s(self) -> float:
        return self.trained_samples / self.seconds


class Step(book.Book):
    """One step's samples, in the scheduling book both the loop and the simulator keep (book.Book: phases,
    queues, groups, hand-outs, the next step begun during it), with their drawn lengths and how far each
    has got. `version`: the updates made when it rolled out (the weights that sample it)."""

    SAMPLE_ARRAYS = book.Book.SAMPLE_ARRAYS + ("length", "critique", "gen", "cgen", "began")

    def __init__(self, workload: Workload, rng: np.random.Generator, index: int = 0, version: int = 0,
                 slots: int = 1):
        self.index, self.version = index, version
        self.length, self.critique = workload.draw(rng)
        super().__init__(len(self.length), workload.group_size, ranks=slots)
        self.prompt, self.judge_template = workload.prompt_tokens, workload.judge_template_tokens
        self.gen = np.zeros(self.n, dtype=np.int64)  # response tokens generated
        self.cgen = np.zeros(self.n, dtype=np.int64)  # critique tokens written
        self.began = np.full(self.n, version)  # the weights each sample began under

    def drawn_tokens(self, i) -> np.ndarray:
        return self.prompt + self.length[i]

    def members(self, group: int) -> slice:
        return slice(group * self.group_size, (group + 1) * self.group_size)

    def begun_here(self) -> slice:
        """The samples the step began: not the groups carried in at its head from the step before
        (--updates ready: book.Book.spill), whose work that step's bounds count, nor those of the steps
        begun after it."""
        return slice(self.carried_in * self.group_size, self.n)

    def judge_all(self) -> None:
        """Every sample generated and judged, as its rounds would leave it: for a step whose rounds
        change nothing that follows them."""
        self.gen[:], self.cgen[:], self.phase[:] = self.length, self.critique, book.JUDGED
        self.tokens[:] = self.drawn_tokens(slice(None))
        self.generated = self.judged = self.n
        self.group_left[:] = 0
        self.queue[Role.ROLLOUT].clear()


def _chunks_before(seconds: float, chunk: float) -> int:
    """Prefill chunks of `chunk` seconds an engine starts within `seconds` of its first: one at least (a
    step under way is finished; the first starts with the round)."""
    return max(1, math.ceil(seconds / chunk - 1e-9))


class Simulation:
    def __init__(self, model: CostModel, workload: Workload, slots: int, placement: str, *, seed: int = 0,
                 config: planner.PlannerConfig | None = None, rules: RoundRules = RoundRules(),
                 prior_steps: int = 1, split: dict[str, int] | None = None, max_staleness: int = 0):
        """`split`: disaggregated's slots per role; by default sized to each role's share of the work.
        `max_staleness`: pivot_train.py's --max-staleness K (pipeline.py)."""
        self.model, self.workload, self.placement = model, workload, placement
        self.max_staleness = max_staleness
        self.rng = np.random.default_rng(seed)
        self.config, self.rules = config, rules
        # The pipeline's shape, decided once: how far ahead of the update the step its rounds roll out to its
        # end is, whether a step may end with groups still out (--updates ready), whether up to K steps begin
        # ahead of that one (deep_pipeline), and how many updates older than its own update's weights a step
        # begins under
        self.ready = pipeline.depth(max_staleness, rules.updates) < max_staleness
        if self.ready and rules.deep_pipeline:
            raise ValueError("RoundRules: deep_pipeline is a what-if of the step-locked pipeline; at --max-staleness "
                             f"{max_staleness} pass updates='step' with it")
        self.pipe = self.pipe_depth(max_staleness, rules)
        self.deep = rules.deep_pipeline and self.pipe < max_staleness
        self.lag = max_staleness if self.deep else self.pipe
        self.speeds = model.planner_speeds(workload, slots)
        # Rank 0 refits each engine's speed from the steps it sees, as LoopPlanner does in pivot_train.py.
        self.fits = {role: planner.LinearFit(speed.step_s, speed.per_seq_s, hi=speed.max_seqs)
                     for role, speed in ((Role.ROLLOUT, self.speeds.rollout), (Role.JUDGE, self.speeds.judge))}
        self.costs = model.planner_costs(slots)
        self.split = {Role.ROLLOUT: slots}
        if placement == "disaggregated":
            self.split = split or self._split(slots)
            if sum(self.split.values()) != slots:
                raise ValueError(f"split {self.split} does not place {slots} slots")
        roles = [role for role, n in self.split.items() for _ in range(n)]
        self.slots = [Slot(i, role) for i, role in enumerate(roles)]
        self.now, self.events, self.counter = 0.0, [], 0
        # Early training: uncontended seconds the train slots have left of the groups handed this round,
        # the cores' sharing they work under now, and the version of their scheduled end; the groups
        # handed (group, tokens, uncontended seconds), whether the train slots are past their time, and
        # whether the round's end (or their time) cut their groups short.
        self.train_left, self.train_share, self.train_version = 0.0, 1.0, 0
        self.train_groups: list[tuple[int, float, float]] = []
        self.train_arrived, self.train_cut = True, False
        # Past their time, the train slots arrive at the end of the group in progress: `train_left` then.
        self.train_arrives_at: float | None = None
        self.shifts, self.shift_seconds, self.rounds = 0, 0.0, 0
        self.slot_s = dict.fromkeys(STATES, 0.0)
        # With a list here (python -m sim --timeline): each slot's work in a role and its shifts, as the
        # loop's timeline.jsonl holds a rank's, each under the update the run was at (`span_step`).
        self.spans: list[dict] | None = None
        self.span_step, self.last_span = 0, {}
        self.phases = {Role.ROLLOUT: 0.0, "judge_tail": 0.0, "train_tail": 0.0}
        # What rank 0 knows of lengths before the step: earlier steps' draws (the first step's prior).
        seen = [workload.draw(self.rng) for _ in range(prior_steps)]
        self.lengths = planner.LengthEstimate(np.concatenate([s[0] for s in seen]), workload.max_response)
        self.critiques = planner.LengthEstimate(np.concatenate([s[1] for s in seen]), workload.max_critique)

    # -- the run ------------------------------------------------------------------------------------

    def run(self, steps: int, skip: int = 0) -> Result:
        """`skip` updates, then `steps` timed ones, as pivot_train.py orders them (pipeline.rollouts):
        each timed from the start of the rollout beside it to its new weights loaded everywhere. At K > 0
        the run first rolls out and judges the pipeline's fill steps (as many as it is deep) and ends with
        the updates that roll nothing out; neither is timed, so each timed update trains one step while
        another rolls out. The run goes on past its last timed step as a longer one would: that step begins
        the next (book.ahead_step), which the first of the last updates rolls out, untimed. So at K > 0 a
        timed step after the first update begins with the work the step before began, and begins the next,
        as every step in the middle of a long run does. Runs at several depths skip so that their timed
        updates roll out the same steps (depth 0 and 2, skip 3 and 1: steps 3 and 4 for two timed
        updates)."""
        k, pipe, deep = self.max_staleness, self.pipe, self.deep
        last = skip + steps + pipe
        step_seconds, samples, trained_samples, tokens, critical, bound, work = [], 0, 0, 0, 0.0, 0.0, 0.0
        pending, trained, result = deque(), [], None
        self.carried, self.ahead_index = None, None  # the next step's work begun by the step before (Step.carry)
        self.begun = -1  # deep_pipeline: the last step begun
        for update in range(last):
            self.span_step = update
            ahead, beside = pipeline.rollouts(update, len(pending), pipe, last)
            for index in ahead:  # the pipeline's fill: rolled out and judged, nothing trained
                pending.append(self._new_step(index, version=0))
                if deep:  # deep_pipeline: the K steps after it begin with it, under the first weights
                    self.begun = index
                    self._begin(pending[-1], index + k, version=0)
                    self._step(pending[-1], None)
                elif self.placement == "disaggregated":  # a fixed split's fill ends as it began, every slot idle
                    pending[-1].judge_all()
                else:
                    self._step(pending[-1], None)
            if update == skip:
                self._start_clock()
            rolled, self.carried = self.carried, None
            if rolled is None and beside < last:
                rolled = self._new_step(beside, version=update)
            assert rolled is None or rolled.index == beside
            # At K > 0 an update made during the rollout is published then, and the next step begins (no
            # checkpoint is simulated): deep_pipeline's K ahead of the step rolled out to its end.
            if deep:  # what an update published after its step's end would have begun begins now
                self._begin(rolled, min(update + k, last + k - 1), version=update)
                self.ahead_index = update + 1 + k if update + 1 + k < last + k else None
            else:
                self.ahead_index = book.ahead_step(beside, k, last + 1, checkpoint=False)
            update_step = pending.popleft() if pipe else rolled
            timed, start = skip <= update < skip + steps, self.now
            if timed:
                path, least = self._critical_path(rolled), self._work_bound(rolled, update_step)
                critical, work, bound = critical + path, work + least, bound + max(least, path / (k + 1))
            self._step(rolled, update_step)
            assert update_step.done() and update_step.through()
            trained.append((update, update_step.index, update_step.version))
            if pipe and rolled is not None:
                pending.append(rolled)
            if rolled is None:  # the pipeline's drain
                continue
            assert rolled.generated == rolled.judged == rolled.n
            self.lengths = planner.LengthEstimate(rolled.length, self.workload.max_response)
            self.critiques = planner.LengthEstimate(rolled.critique, self.workload.max_critique)
            if not timed:
                continue
            if update == skip + steps - 1:  # the last step ends with the new policy loaded everywhere
                self._wait_until(max(s.ready_at for s in self.slots), state="waiting")
            step_seconds.append(self.now - start)
            self.phases[Role.ROLLOUT] += self.rollout_end - start
            self.phases["judge_tail"] += self.judge_end - self.rollout_end
            self.phases["train_tail"] += self.now - self.judge_end
            # A step's draw per update: under --updates ready an update trains between half a step's worth of
            # groups and one and a half (book.SPILL_SHARE), so over a few timed updates the groups spilled into
            # or out of the window would count; throughput is the steps' draws at the updates' pace. What
            # the updates trained is kept beside it: a rule that changes how many groups the timed updates
            # take moves the one and not the other
            drawn = self.workload.prompts * self.workload.group_size
            samples += drawn
            trained_samples += int(update_step.trained.sum()) * update_step.group_size
            tokens += int(update_step.length.sum() * drawn / update_step.n)
            if update == skip + steps - 1:
                result = Result(self.placement, len(self.slots), self.now - self.origin, samples, trained_samples,
                                tokens, self.shifts, self.shift_seconds / max(self.shifts, 1), step_seconds,
                                dict(self.split), dict(self.slot_s), dict(self.phases), critical, self.rounds,
                                bound, work, trained, self.spans)
        return result

    @staticmethod
    def pipe_depth(max_staleness: int, rules: RoundRules) -> int:
        """How many updates after its rollout a step is trained in the update whose rounds roll it out to
        its end: the loop's (pipeline.depth: K step-locked, K - 1 ready-first at K >= 2, whose groups still
        out as a step ends go on into the step after), or 1 under deep_pipeline, whose steps begin up to K
        ahead of it."""
        if rules.deep_pipeline:
            return min(max_staleness, 1)
        return pipeline.depth(max_staleness, rules.updates)

    def _begin(self, head: Step, last: int, version: int) -> None:
        """deep_pipeline: every step up to `last` not begun yet begins now, under weights `version`, behind
        `head` and the steps begun after it."""
        for index in range(self.begun + 1, last + 1):
            head.extend(self._new_step(index, version=version))
        self.begun = max(self.begun, last)

    def _new_step(self, index: int, version: int) -> Step:
        """Step `index`'s samples, drawn now, rolled out under weights `version`."""
        return Step(self.workload, self.rng, index, version=version, slots=len(self.slots))

    def _start_clock(self) -> None:
        """What the timed updates take is counted from now: the pipeline's fill and the skipped updates
        are left out."""
        self.origin, self.shifts, self.shift_seconds, self.rounds = self.now, 0, 0.0, 0
        self.slot_s = dict.fromkeys(STATES, 0.0)

    def _step(self, step: Step | None, update: Step | None) -> None:
        """Rounds until rank 0 hears `step`'s last verdict, the train slots working through `update`'s
        groups early where the placement trains early, then the rest of `update`. At K = 0 the two are
        one step; a fill step has no update, a drain update no step."""
        self.step, self.update, self.rollout_end = step, update, None
        self.made = self.published = False
        while step is not None:
            self._ingest()
            if self.rollout_end is None and step.generated == step.n:
                self.rollout_end = self.now
            if step.done() or self.ready and step.may_end():
                break
            making = self._update_due()  # made at this round's start, then published (scheduler._decide)
            if book.publish_due(self.made or making, self.published, self.ahead_index is not None):
                self._publish()
            self.made = self.made or making
            roles, rnd = self._orders()
            self._migrate(roles)
            self._apply(roles, grads=self._grads())
            if self.rules.migrate_at_once:
                for slot in self.slots:
                    self.step.requeue(slot.exported)
                    slot.exported = []
            self._dispatch(rnd)
            self._hand_to_train()
            if self._round(rnd):
                self.rounds += 1
                self._exchange()
            elif not any(s.exported for s in self.slots):  # nothing to do until a shift ends (no stall)
                moving = [s.ready_at for s in self.slots if s.ready_at > self.now]
                assert moving, "a round in which no slot could work"
                self._wait_until(min(moving))
        self.judge_end = self.now
        if self.rollout_end is None:  # --updates ready: the step ended with responses still to come
            self.rollout_end = self.now
        if step is not None and step.aheads:
            self._carry(step)
        if update is not None:
            self._finish(update)

    def _carry(self, step: Step) -> list[int]:
        """The engines export the next step's sequences, in slot order, which go on in it (Step.carry); or,
        under carry_running, keep them, renumbered as the next step's book numbers them."""
        number = None if step.done() else step.spill()  # --updates ready: its groups still out go on in the next
        exported = []
        for slot in self.slots:
            if number is not None:
                slot.running = number[slot.running].tolist()
            if self.rules.carry_running:
                slot.running = [i - step.n for i in slot.running]
            else:
                exported += slot.running
                slot.running, slot.prefill_s = [], 0.0
        self.carried = step.carry(exported)
        return exported

    def _update_due(self) -> bool:
        """Whether the train slots make the update now, at the round's start (book.update_due, as
        StepQueues.update_due): it is an earlier step's, and they have trained every group of it."""
        update, early = self.update, self.max_staleness > 0 and self._early_train()
        trained = early and update.through()
        return book.update_due(early, trained, self.made)

    def _publish(self) -> None:
        """The update made at this round's start or an earlier one is published now, every slot taking part
        (StepQueues.publish); each rollout engine loads it and prefills its running sequences again under
        it (counted as engine time before it decodes on), and the next step's samples join the queue."""
        trainers = sum(s.role == Role.TRAIN for s in self.slots)
        self._wait_until(self.now + self.model.publish_seconds(max(1, trainers)), state="waiting")
        reload = self.model.shift_seconds(Role.ROLLOUT, Role.ROLLOUT, max(1, trainers), False)
        for slot in self.slots:
            if slot.role == Role.ROLLOUT:
                slot.prefill_s += reload + self._context(Role.ROLLOUT, slot.running) / self.model.prefill_per_s[Role.ROLLOUT]
        self.step.extend(self._new_step(self.ahead_index, version=self.ahead_index - self.lag))
        self.begun = self.ahead_index
        self.published = True

    def _grads(self) -> bool:
        """Whether the train slots hold gradients accumulated early, which a change of group carries."""
        return self.update is not None and bool(self.update.trained.any())

    def _orders(self) -> tuple[list[str], Round]:
        """Rank 0's orders (the loop's Placement.next_roles): every slot's role from now on, and how long the
        round lasts."""
        roles, step, rules = [s.role for s in self.slots], self.step, self.rules
        timed = Round(step.round_seconds(rules.round_steps, first_engine_step_s=rules.first_engine_step_s,
                                         over_exchange=rules.over_exchange, over_longest=rules.over_longest),
                      early=True)
        if self.placement == "colocated":  # book.Book.colocated, as shifting/scheduler.py colocated_roles
            in_flight = {role: sum(len(s.running) for s in self.slots if s.role == role) for role in ENGINE_ROLES}
            role, is_timed = step.colocated(self.slots[0].role, in_flight)
            return [role] * len(roles), timed if is_timed else Round(None, early=False)
        if self.placement == "pivot":
            return planner.apply_moves(roles, self._plan(timed.seconds)), timed
        return roles, timed

    def _apply(self, roles: list[str], grads: bool) -> None:
        """The shift to `roles`. A train group whose members change is made anew, collectively: the slots
        that stay in it reshard their state too, with `grads` (groups trained early, before the
        optimizer step) the gradients move through storage with it (shifting/context.py, storage.py
        TrainState.partial), and every slot waits for the longest shift. A shift between engine roles
        holds the shifting slot alone (and every slot, under `shifts_stall_all`)."""
        before = {s.index for s in self.slots if s.role == Role.TRAIN}
        after = {i for i, role in enumerate(roles) if role == Role.TRAIN}
        for slot, role in zip(self.slots, roles):
            self._shift(slot, role, len(after), grads)
        if before and after and before != after:
            for i in before & after:
                self._reshard(self.slots[i], len(after), grads)
        if self.rules.shifts_stall_all or after and before != after:
            self._wait_until(max([self.now] + [s.ready_at for s in self.slots]), state="waiting")

    def _dispatch(self, rnd: Round) -> None:
        """Each engine role's queue shared among the slots holding it, evening out their loads up to each
        engine's room, in slot order from the queue's head (book.Book.dispatch); a slot still shifting takes
        its share too, as the loop's rank does before it shifts, and works on it once shifted. A slot's
        first step takes its new requests in."""
        for role in ENGINE_ROLES:
            held = [s for s in self.slots if s.role == role]
            takes = self.step.dispatch(role, [len(s.running) for s in held], self._capacity(role, rnd.seconds),
                                       self._budget(role, rnd), lambda i: self._context(role, [i]))
            for slot, new in zip(held, takes):
                slot.running += new
                # A resumed sequence prefills what it had generated too.
                slot.prefill_s += self._context(role, new) / self.model.prefill_per_s[role]

    def _capacity(self, role: str, seconds: float | None) -> int:
        """The most sequences an engine of `role` takes in for a round of `seconds` (Placement.capacity in
        shifting/placement.py): pivot's intake (book.intake: a judge engine's holds back what it would crowd
        in) from rank 0's fit of the role's engine steps and the critiques' mean length, given its sequences
        queued and running; the others', and pivot's without `RoundRules.intake`, the engine's room."""
        room = self.model.max_seqs[role]
        if role == Role.ROLLOUT and self.placement == "pivot":
            return int(room * self.rules.rollout_hold)
        if not self.rules.intake or self.placement != "pivot":
            return room
        step_s, per_seq_s = self.fits[role].fit()
        seqs = len(self.step.queue[role]) + sum(len(s.running) for s in self.slots if s.role == role)
        return book.intake(role, step_s, per_seq_s, room, seqs, len(self.slots), seconds, self.critiques.mean())

    def _budget(self, role: str, rnd: Round) -> float | None:
        """The context tokens of new work one of the role's engines takes in this round (book.prefill_budget,
        as Placement.budget in pivot_train.py; the planner's prefill speed is the model's): at K = 0 pivot's
        judge engines what they prefill in a timed round, or before the rollout slots that get no more work
        are expected to run empty (planner.first_empty_seconds at rank 0's fit of their steps); under
        RoundRules.prefill_intake, its roles' at any K; none without RoundRules.prefill_budget, and for the
        other placements."""
        if self.placement != "pivot" or rnd.seconds is None:
            return None
        speed = self.speeds.rollout if role == Role.ROLLOUT else self.speeds.judge
        synchronous = role in self.rules.prefill_intake or self.rules.prefill_budget and self.max_staleness == 0
        return book.prefill_budget(role, synchronous, rnd.seconds, speed.prefill_per_s,
                                   roles=(Role.JUDGE, *self.rules.prefill_intake), until_empty_s=self._until_empty)

    def _until_empty(self) -> float | None:
        """planner.first_empty_seconds of the rollout slots, at rank 0's fit of their steps, while no prompt
        waits for rollout (as StepQueues.dispatch gives the loop's Placement.budget); None otherwise."""
        if self.step.queue[Role.ROLLOUT]:
            return None
        running = [self.step.gen[s.running].tolist() for s in self.slots if s.role == Role.ROLLOUT and s.running]
        fitted = replace(self.speeds.rollout, **dict(zip(("step_s", "per_seq_s"), self.fits[Role.ROLLOUT].fit())))
        return planner.first_empty_seconds(fitted, running, self.lengths, len(self.slots))

    def _hand_to_train(self) -> None:
        """Early training (pivot_train.py: pivot with one minibatch): every judged group no train slot
        has had, in prompt order (book.Book.ready, as StepQueues.hand_to_train). The train slots work through them until
        the round ends, stopping at the first group boundary after it (`_cut_training`); the groups
        they did not reach are handed out again."""
        trainers = sum(s.role == Role.TRAIN for s in self.slots)
        ready = all(s.ready_at <= self.now for s in self.slots if s.role == Role.TRAIN)  # the group trains together
        if not (self._early_train() and trainers and ready):
            return
        rate = trainers * self.model.train_per_s(trainers)
        for group in self.update.ready():
            tokens = float(self.update.drawn_tokens(self.update.members(group)).sum())
            self.train_groups.append((group, tokens, tokens / rate))
        self.train_left = sum(seconds for _, _, seconds in self.train_groups)

    def _group_in_progress(self) -> tuple[int, float, float]:
        """The train slots' handed groups up to the one in progress (how many), the uncontended seconds
        into them at its end, and those done now."""
        done, end, kept = sum(seconds for _, _, seconds in self.train_groups) - self.train_left, 0.0, 0
        while kept < len(self.train_groups) and end < done - 1e-12:
            end += self.train_groups[kept][2]
            kept += 1
        return kept, end, done

    def _train_arrive(self) -> None:
        """The train slots, past their time, reach a group boundary: they have arrived, as the loop's train
        ranks do when they look at the round's end between two groups (RoundEnd.stop in _train). The last
        to arrive, they see the round over and stop there; else they go on with the next group until
        every slot has arrived."""
        self.train_arrived, self.train_arrives_at = True, None
        if self._all_arrived() and self.round_end == math.inf:  # the last to arrive: they stop here
            self._cut_training()
            self._end_round()

    def _cut_training(self) -> None:
        """The round is over for the train slots: they finish the group in progress; the groups after it
        are handed out again."""
        kept, end, done = self._group_in_progress()
        self.train_groups, self.train_cut = self.train_groups[:kept], True
        self.train_left = max(0.0, end - done)
        self.train_arrives_at = None  # the round is over: they stop at that boundary
        self._retime(None)

    def _early_train(self) -> bool:
        """Whether train slots work through the update's judged groups while the step rolls out and
        judges, as pivot_train.py's Placement.early_train says: pivot, and at K > 0 (the groups are an
        earlier step's) disaggregated's fixed train slots too; a fill step has no update."""
        overlaps = self.placement == "pivot" or self.placement == "disaggregated" and self.max_staleness > 0
        return self.update is not None and self.config is not None and self.config.early_train and overlaps

    def _emptied_enough(self) -> bool:
        """Whether enough slots have run empty (engines, or train slots through their groups) to end the round."""
        return self.emptied >= book.empty_enough(len(self.slots), self.rules.empty_share)

    def _all_arrived(self) -> bool:
        return all(s.arrived for s in self.slots) and (self.train_left == 0 or self.train_arrived)

    def _round(self, rnd: Round) -> bool:
        """The slots work until the round ends; returns whether any engine stepped or slot trained."""
        self.round, start = rnd, self.now
        self.events.clear()
        self.round_end = math.inf  # once every slot has arrived (step_on) or enough ran empty (early rounds)
        self.emptied = 0
        for s in self.slots:  # a slot still shifting has taken its work, and starts on it (and its time) once shifted
            s.t, s.stepped, s.version, s.chunks = max(start, s.ready_at), False, s.version + 1, None
            s.halt = s.t + rnd.seconds if rnd.seconds is not None else math.inf
            s.stopped = s.arrived = s.role not in ENGINE_ROLES or not s.running
        self.train_arrived, self.train_arrives_at, self.train_cut = self.train_left == 0, None, False
        if not self.train_arrived and rnd.seconds is not None:
            self._push(start + rnd.seconds, -2, 0)  # the train slots' time
        self._retime(None)
        for s in self.slots:
            if s.ready_at > start and not s.stopped:  # its engine joins those sharing the cores then
                self._push(s.ready_at, s.index, s.version)
        trained = self.train_left > 0
        while self.train_left > 0 or not all(s.stopped for s in self.slots):
            t, _, index, version = heapq.heappop(self.events)
            assert t >= self.now - 1e-9, "the clock ran backwards"
            self._wait_until(t)
            if index == -1 and version == self.train_version:  # the train slots are through their groups
                self.train_left = 0.0
                if rnd.early and self.rules.trained_through and not self.train_cut:  # as run empty
                    self.emptied += sum(s.role == Role.TRAIN for s in self.slots)
                if self._emptied_enough() and self.round_end == math.inf or self.rules.step_on and self._all_arrived():
                    self._end_round()
                self._retime(None)
            elif index == -2 and self.train_left > 0:  # past their time: they arrive at the next group boundary
                if not self.rules.step_on:
                    self.train_arrived = True
                    self._cut_training()
                else:  # `train_left` once through the group in progress; _retime schedules it
                    _, end, done = self._group_in_progress()
                    self.train_arrives_at = self.train_left - (end - done)
                    self._retime(None)
            elif index == -4 and version == self.train_version and self.train_arrives_at is not None:
                self._train_arrive()
            elif index == -3 and self.train_left > 0:  # they see the round's end
                self._cut_training()
            elif index >= 0 and version == self.slots[index].version:
                self._touch(self.slots[index])
        if self.train_groups:
            self.update.train([group for group, _, _ in self.train_groups])
        self.train_groups = []
        return trained or any(s.stepped for s in self.slots)

    def _exchange(self) -> None:
        """Every slot reports to rank 0 and waits for its orders: the round's exchange and rank 0's choice of
        roles."""
        end = self.now + self.model.exchange_seconds(self.placement, len(self.slots))
        if self.step is not None:
            self.step.exchange_s = end - self.now
        self._account(end, state="exchange")
        self.now = end

    def _migrate(self, roles: list[str]) -> None:
        """Where a slot leaves an engine role with sequences running, every slot sends rank 0 what it exports
        and waits for the round's work (the loop's _migrate), once more the cost of an exchange."""
        if self.rules.migrate_at_once and book.migrates([s.role for s in self.slots],
                                                        [len(s.running) for s in self.slots], roles):
            self._exchange()

    def _ingest(self) -> None:
        """Rank 0 reads the reports, in slot order (book.Book.ingest, as StepQueues.ingest)."""
        for slot in self.slots:
            self.step.ingest(slot.finished, slot.exported, self.step.drawn_tokens)
            slot.finished, slot.exported = [], []

    def _finish(self, step: Step) -> None:
        """The rest of `step`'s update (book.update_roles: colocated, pivot on every slot, but pivot's train
        slots alone where that is no slower, as rank 0 finds it (Placement.update_alone, from the planner's
        training speed and shift costs); disaggregated: its train slots), publishing, the rollout engines'
        reload, and the roles the next step begins with (book.next_step_roles)."""
        everyone = self.placement != "disaggregated"
        # Made at a round's start while the step ran (book.update_due; pivot_train.py's
        # update_during_rollout), the update needs no slot to move to train. One whose last groups were
        # trained in the step's last round is made now, by the slots book.update_roles names, as the loop
        # makes it.
        held = [s.role for s in self.slots]  # as the step's rounds ended
        if not self.made:  # disaggregated's fixed roles are its split: the rule keeps them
            roles, grads = held, bool(step.trained.any())
            alone = self._early_train() and self._update_alone(step, roles, grads)
            self._apply(book.update_roles(roles, None if everyone else roles, alone), grads=grads)
        trainers = [s for s in self.slots if s.role == Role.TRAIN]
        left, n = step.train_work()[0], max(1, len(trainers))
        # Nothing else works now: the trainers share the cores among themselves.
        publish = 0.0 if self.published else self.model.publish_seconds(n)  # else it went out during the step
        end = self.now + left / (n * self.model.train_per_s(n)) * self.model.contention(n) + publish
        self._account(end, state=Role.TRAIN)
        self.now = end
        step.train(step.ready())
        if everyone:
            self._apply(book.next_step_roles(held, [Role.ROLLOUT] * len(self.slots), self.placement == "pivot",
                                             self.max_staleness), grads=False)
        elif not self.published:  # a reload of the new weights, not a change of role; collective like any apply
            for slot in self.slots:
                if slot.role == Role.ROLLOUT:
                    slot.ready_at = self.now + self.model.shift_seconds(Role.ROLLOUT, Role.ROLLOUT, n, False)
                    self._span(slot.index, "shift", self.now, slot.ready_at, src=Role.ROLLOUT, dst=Role.ROLLOUT)
            if self.rules.shifts_stall_all:
                self._wait_until(max(s.ready_at for s in self.slots), state="waiting")

    def _update_alone(self, step: Step, roles: list[str], grads: bool) -> bool:
        """Whether the train slots make the update alone (planner.update_seconds, as rank 0 asks it in
        Placement.update_alone): rank 0 knows the shifts' costs from those it has seen; here, the model's
        into a group of every slot."""
        into = {(role, Role.TRAIN): self.model.shift_seconds(role, Role.TRAIN, len(roles), grads) for role in ROLES}
        return planner.update_seconds(step.train_work()[0] / self.speeds.train_per_s, roles, into)[1]

    def _critical_path(self, step: Step, block: int = 64) -> float:
        """A lower bound on the step, whatever the placement: its slowest sample generated and then
        judged alone, at batch 1, with no shift, each reported to rank 0 in a round's exchange, then the
        update on every slot, of that sample's group where pivot trains groups early, else of all, and
        publishing. Each engine step is charged the context at the start of its block of
        `block` tokens (steps only grow with context); the candidates are the samples it began
        (Step.begun_here) longest in response, critique and both."""
        m, n, g = self.model, len(self.slots), step.group_size
        early = self.config is not None and self.config.early_train
        exchange = min(m.exchange_seconds(p, n) for p in ("colocated", "pivot"))

        def alone(role: str, context: int, tokens: int) -> float:
            return sum(m.engine_step_seconds(role, 1, context + k) * min(block, tokens - k)
                       for k in range(0, tokens, block))

        own = step.begun_here()
        top = lambda x: (own.start + np.argsort(x[own])[-8:]).tolist()  # noqa: E731
        candidates = set(top(step.length)) | set(top(step.critique)) | set(top(step.length + step.critique))
        judge_prompt = step.prompt + step.judge_template
        return max(step.prompt / m.prefill_per_s[Role.ROLLOUT] + alone(Role.ROLLOUT, step.prompt, int(step.length[i]))
                   + (judge_prompt + step.length[i]) / m.prefill_per_s[Role.JUDGE]
                   + alone(Role.JUDGE, judge_prompt + int(step.length[i]), int(step.critique[i]))
                   + float(step.drawn_tokens(step.members(i // g) if early else slice(None)).sum())
                   / (n * m.train_per_s(n))
                   for i in candidates) + 2 * exchange + m.publish_seconds(n)

    def _work_bound(self, step: Step, update: Step) -> float:
        """A lower bound on the update's seconds from its work alone: the decoding, judging and prefill
        of the samples `step` began (Step.begun_here) and `update`'s training, each at the least
        slot-seconds the cost model allows per token (CostModel.token_seconds: the best batch, and each
        decode step's context as it grows token by token), spread evenly over every slot (over the cores,
        where slots share fewer), with no shift, exchange, idling or publishing."""
        m, judge_prompt = self.model, step.prompt + step.judge_template
        slots = min(len(self.slots), m.cores or len(self.slots))
        seconds = 0.0
        own = step.begun_here()
        for role, prompts, lengths in ((Role.ROLLOUT, np.full(own.stop - own.start, step.prompt), step.length[own]),
                                       (Role.JUDGE, judge_prompt + step.length[own], step.critique[own])):
            per_token, per_context = m.token_seconds(role)
            prompts, lengths = prompts.astype(np.float64), lengths.astype(np.float64)
            context = float((lengths * prompts + lengths * (lengths - 1) / 2).sum())
            seconds += per_token * lengths.sum() + per_context * context + prompts.sum() / m.prefill_per_s[role]
        train = max(m.train_per_s(n) for n in range(m.min_train_slots, len(self.slots) + 1))
        return (seconds + float(update.drawn_tokens(slice(None)).sum()) / train) / slots

    # -- engines ------------------------------------------------------------------------------------

    def _touch(self, slot: Slot) -> None:
        """Brings the slot's engine to now: steps taken, sequences finished; it stops for the round when
        it runs empty (cutting the round short where the round says so) or reaches its limit. A slot still
        in an engine step (a prefill chunk it began as its shift ended) arrives only at that step's end,
        as the loop's rank looks at the round's end between two engine steps (scheduler.py _work)."""
        self._advance(slot)
        self._complete(slot)
        if slot.running and slot.t > self.now + 1e-9:  # still in a step: touched again at its end
            self._retime(slot)
            return
        if slot.running and self._steps_before_halt(slot) == 0 and self.rules.step_on and not slot.arrived \
                and self.round_end == math.inf:
            slot.arrived, slot.halt = True, math.inf  # steps on until every slot has arrived
            if self._all_arrived():  # the last to arrive ends the round
                slot.stopped = True
                self._end_round()
                return
        elif not slot.running or self._steps_before_halt(slot) == 0:
            slot.stopped = slot.arrived = True
            if not slot.running and slot.stepped and self.round.early:
                self.emptied += 1
            if self._emptied_enough() or self.rules.step_on and self._all_arrived():
                self._end_round()
                return
        self._retime(slot)

    def _end_round(self) -> None:
        """The round is over now: every slot stops at its first step boundary (or group boundary) after it
        learns so through the store, `notice_s` later (the loop's RoundEnd); a slot taking in its new work
        stops after the prefill chunk in progress then, and the rest waits for the next round."""
        seen = self.now + self.rules.notice_s
        self.round_end = min(self.round_end, seen)
        for s in self.slots:
            s.halt = min(s.halt, seen)
            if s.chunks is not None and s.t == s.chunks[3] > seen:  # the chunk in progress is its last
                start, chunk, share, end = s.chunks
                s.t = min(end, start + _chunks_before(seen - start, chunk) * chunk)
                s.prefill_s += (end - s.t) / share
                s.chunks = None
        if self.train_left > 0:
            self._push(seen, -3, 0)
        self._retime(None)

    def _retime(self, touched: Slot | None) -> None:
        """Sets the step time of the touched slot's engine and schedules its next event; with None, or
        where engines share cores, of every working engine."""
        working = [s for s in self.slots if s.role in ENGINE_ROLES and not s.stopped]
        shared = self.model.cores is not None
        slots = working if shared or touched is None else [s for s in [touched] if not s.stopped]
        busy = self._busy()
        share = self.model.contention(busy)
        # A round's prefills run beside every slot it gives work to, those still shifting into their role too.
        prefill_share = self.model.contention(self._busy(shifting=True)) if shared else share
        if self.train_left > 0 and (shared or touched is None):
            self.train_share, self.train_version = share, self.train_version + 1
            self._push(self.now + self.train_left * share, -1, self.train_version)
            if self.train_arrives_at is not None:
                self._push(self.now + (self.train_left - self.train_arrives_at) * share, -4, self.train_version)
        for s in slots:
            batch = self._batch(s)
            step_s = self.model.engine_sharing(s.role, busy) * self.model.engine_step_seconds(
                s.role, len(batch), self._context(s.role, batch))
            if s is not touched:
                self._advance(s)  # whole steps at its old speed
            if s.step_s and s.t < self.now:  # the fraction of a step it is into carries over
                s.t = self.now - (self.now - s.t) / s.step_s * step_s
            s.step_s = step_s
            if s.prefill_s and not s.stepped:
                self._prefill(s, prefill_share)
            s.version += 1
            left = int((self._target(s.role, batch) - self._progress(s.role)[batch]).min())
            steps = min(left, self._steps_before_halt(s))
            self._push(max(self.now, s.t + steps * s.step_s), s.index, s.version)

    def _prefill(self, slot: Slot, share: float) -> None:
        """The round's first engine steps take in the slot's new requests, at most a chunk of
        `prefill_chunk_tokens` a step (vLLM's chunked prefill), those that start before the round's
        halt; its sequences decode once all is in (the one token a chunk step also decodes for each
        running sequence is left out). What is left waits for the next round, as does what a round that
        ends sooner leaves after the chunk in progress (_end_round)."""
        chunk = share * self.model.prefill_chunk_tokens / self.model.prefill_per_s[slot.role]
        left = share * slot.prefill_s
        chunks = max(1, math.ceil(left / chunk - 1e-9))
        if slot.halt < math.inf:
            chunks = min(chunks, _chunks_before(slot.halt - slot.t, chunk))
        seconds = min(left, chunks * chunk)
        slot.t += seconds
        slot.prefill_s = max(0.0, slot.prefill_s - seconds / share)
        slot.stepped = True
        self.step.recent_steps.add(seconds / chunks, chunks)
        slot.chunks = (slot.t - seconds, chunk, share, slot.t)
        if slot.prefill_s:
            slot.halt = min(slot.halt, slot.t)

    def _steps_before_halt(self, slot: Slot) -> float:
        """Engine steps the slot may still start this round: the first starts with the round, whatever
        its limit (it also takes in the round's new requests)."""
        if slot.halt == math.inf:
            return math.inf
        more = math.ceil((slot.halt - slot.t) / slot.step_s - 1e-9) if slot.step_s else 1
        return max(0 if slot.stepped else 1, more)

    def _account(self, t: float, state: str | None = None) -> None:
        """Each slot's seconds from now to t, by state (STATES; nothing changes state in between but the
        end of a shift). `state`: what every slot not shifting does meanwhile ("exchange", "waiting";
        Role.TRAIN: the step's last update, which the train slots do while the others idle); None: a
        round's work, slot by slot."""
        span = max(t - self.now, 0.0)
        for s in self.slots:
            shifting = min(max(s.ready_at - self.now, 0.0), span)
            self.slot_s["shifting"] += shifting
            if state in ("exchange", "waiting"):
                self.slot_s[state] += span - shifting
                continue
            working = (state == Role.TRAIN or state is None and self.train_left > 0) if s.role == Role.TRAIN else \
                state is None and bool(s.running) and not s.stopped
            waiting = state is None and s.stopped and bool(s.running)
            self.slot_s[s.role if working else "waiting" if waiting else f"{s.role} idle"] += span - shifting
            if self.spans is not None and working and span > shifting:
                self._span(s.index, s.role, self.now + shifting, t)

    def _wait_until(self, t: float, state: str | None = None) -> None:
        if t > self.now:
            self._account(t, state)
            self.train_left = max(0.0, self.train_left - (t - self.now) / self.train_share)
            self.now = t

    def _busy(self, shifting: bool = False) -> int:
        """Slots working now: engines with sequences, train slots with judged groups to train on; with
        `shifting`, those still shifting into their role count too (they start on their work once shifted)."""
        return sum((shifting or s.ready_at <= self.now)
                   and (not s.stopped if s.role in ENGINE_ROLES else self.train_left > 0) for s in self.slots)

    def _advance(self, slot: Slot) -> None:
        """Whole engine steps up to now, none past its halt; the engine's time stays at the last step's
        end, so a slot touched often loses no fraction of a step."""
        if not slot.running or slot.stopped or not slot.step_s:
            return
        progress, batch = self._progress(slot.role), self._batch(slot)
        left = int((self._target(slot.role, batch) - progress[batch]).min())
        steps = min(left, self._steps_before_halt(slot), max(0, int((self.now - slot.t) / slot.step_s + 1e-9)))
        if steps > 0:
            progress[batch] += steps
            slot.t += steps * slot.step_s
            slot.stepped = True
            self.step.recent_steps.add(slot.step_s, steps)

    def _complete(self, slot: Slot) -> None:
        done = [i for i in slot.running if self._progress(slot.role)[i] >= self._target(slot.role, i)]
        if done:
            slot.running = [i for i in slot.running if i not in set(done)]
            slot.finished += done

    def _batch(self, slot: Slot) -> list[int]:
        """The sequences the slot's engine steps: its first `max_seqs` (vLLM's max_num_seqs); the others it
        holds wait in its engine, in order, and start as those finish."""
        return slot.running[:self.model.max_seqs[slot.role]]

    def _progress(self, role: str) -> np.ndarray:
        return self.step.gen if role == Role.ROLLOUT else self.step.cgen

    def _target(self, role: str, i):
        return self.step.length[i] if role == Role.ROLLOUT else self.step.critique[i]

    def _context(self, role: str, running: list[int]) -> float:
        step = self.step
        if role == Role.ROLLOUT:
            return float(len(running) * step.prompt + step.gen[running].sum())
        return float(len(running) * (step.prompt + step.judge_template) + step.length[running].sum()
                     + step.cgen[running].sum())

    # -- shifts -------------------------------------------------------------------------------------

    def _plan(self, seconds: float) -> list[planner.Move]:
        """Pivot's moves before a round of `seconds`."""
        for s in self.slots:
            if s.role in ENGINE_ROLES and s.running and s.step_s:
                self.fits[s.role].observe(len(self._batch(s)), s.step_s)
        # An engine steps no more than its room at once, whatever it holds (RoundRules.rollout_hold)
        room = {role: min(self._capacity(role, seconds), self.model.max_seqs[role]) for role in self.fits}
        speeds = replace(self.speeds, **{role: replace(getattr(self.speeds, role), max_seqs=room[role],
                                                        **dict(zip(("step_s", "per_seq_s"), fit.fit())))
                                         for role, fit in self.fits.items()})
        ranks = [planner.Rank(s.role, int(self._context(s.role, s.running)) if s.role in ENGINE_ROLES else 0,
                              self.now - s.shifted_at) for s in self.slots]
        return planner.plan(ranks, self._work(), speeds, self.costs, self.config)

    def _shift(self, slot: Slot, role: str, train_slots: int, grads: bool) -> None:
        """Moves a slot to `role`: its engine exports its running sequences, which rank 0 queues again
        (RoundRules.migrate_at_once)."""
        if slot.role == role:
            return
        if slot.role in ENGINE_ROLES:
            slot.exported += slot.running
            slot.running, slot.prefill_s = [], 0.0
        self._reshard(slot, train_slots, grads, role)
        slot.role, slot.shifted_at = role, self.now
        slot.step_s = 0.0

    def _reshard(self, slot: Slot, train_slots: int, grads: bool, role: str = Role.TRAIN) -> None:
        """The slot's shift from its role to `role` (train to train: a reshard), counted as a shift."""
        seconds = self.model.shift_seconds(slot.role, role, train_slots, grads)
        self.shifts, self.shift_seconds = self.shifts + 1, self.shift_seconds + seconds
        start = max(slot.ready_at, self.now)
        slot.ready_at = start + seconds
        self._span(slot.index, "shift", start, slot.ready_at, src=slot.role, dst=role)

    def _span(self, rank: int, role: str, start: float, end: float, src: str = "", dst: str = "") -> None:
        """A span of the slot's work in `role` (merged with its last where one follows the other) or of a
        shift from `src` to `dst`, where the run keeps them (`spans`)."""
        if self.spans is None:
            return
        last = self.last_span.get(rank)
        if role != "shift" and last and last["role"] == role and last["step"] == self.span_step \
                and start - last["end"] < 1e-9:
            last["end"] = end
            return
        span = {"step": self.span_step, "rank": rank, "role": role, "start": start, "end": end}
        self.spans.append(span | ({"from": src, "to": dst} if role == "shift" else {}))
        self.last_span[rank] = self.spans[-1]

    def _work(self) -> planner.Work:
        """What rank 0 tells the planner, built as LoopPlanner.work builds it (planner.step_work): with a
        train pool (K > 0) the update's groups are an earlier step's, all judged; otherwise this step's,
        as each is judged; none ready where no slot trains early (a fill step hands no group out). The
        update's tokens are the book's (book.Book.train_work): a response's length counts once it is
        generated, as the loop knows it, not as drawn."""
        step, w = self.step, self.workload
        pool = self.update or step
        rolling = np.flatnonzero(step.phase <= book.ROLLING)
        queued = list(step.queue[Role.ROLLOUT])
        ready, generated, coming = pool.train_work()
        return planner.step_work(
            rolling=step.gen[rolling].tolist(), judging=step.cgen[np.flatnonzero(step.phase == book.JUDGING)].tolist(),
            rollout_prefill=float(len(queued) * step.prompt + step.gen[queued].sum()),
            judge_waiting=len(step.queue[Role.JUDGE]),
            judge_prefill=float(sum(step.prompt + step.judge_template + step.length[i] for i in step.queue[Role.JUDGE])),
            prompt_tokens=w.prompt_tokens, judge_template_tokens=w.judge_template_tokens,
            train_ready=ready, train_generated=generated, train_coming=coming, early_train=self._early_train(),
            update_early=self.update is not None and self.max_staleness > 0,
            lengths=self.lengths, critiques=self.critiques, spill=self.ready, group_size=w.group_size)

    def _split(self, slots: int) -> dict[str, int]:
        """Disaggregated: slots per role in proportion to each role's slot-seconds of work in a step at
        the expected lengths (the planner's own model), each role at least what it needs."""
        n, s = self.workload.prompts * self.workload.group_size, self.speeds
        lengths, critiques = self.workload.draw(np.random.default_rng(0))
        rollout = planner.engine_seconds(s.rollout, 1, n, float(lengths.sum()), 0.0, n * self.workload.prompt_tokens)
        judge = planner.engine_seconds(s.judge, 1, n, float(critiques.sum()), 0.0, float(lengths.sum())
                                       + n * (self.workload.prompt_tokens + self.workload.judge_template_tokens))
        train = float(n * self.workload.prompt_tokens + lengths.sum()) / s.train_per_s
        total = rollout + judge + train
        t = max(self.model.min_train_slots, round(slots * train / total))
        g = max(1, round(slots * judge / total))
        if slots - t - g < 1:
            raise ValueError(f"{slots} slots cannot hold a disaggregated split: train needs {t}, the judge {g}, "
                             f"rollout 1; simulate more devices")
        return {Role.ROLLOUT: slots - t - g, Role.JUDGE: g, Role.TRAIN: t}

    def _push(self, t: float, slot: int, version: int) -> None:
        self.counter += 1
        heapq.heappush(self.events, (t, self.counter, slot, version))
