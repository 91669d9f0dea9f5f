"""Discrete-event simulation of synchronous GRPO steps with a GenRM on N slots, in three placements:

  colocated      every slot rolls out, then every slot judges, then every slot trains
  disaggregated  a fixed split of slots per role, sized to each role's share of the step's work;
                 responses stream to the judge, judged groups to the train slots
  pivot          rank 0 runs planner.py every `interval` seconds and moves slots between roles; a slot
                 leaving an engine role hands its running sequences back to the queue's head, and they
                 resume elsewhere after prefilling prompt + generated again
Each step of every placement ends the same way: its update runs (colocated and pivot: on every slot),
the new policy is published to storage, and the rollout engines load it.

Engines batch continuously: between two events a slot's batch is fixed, so every engine step costs
the same and the next event is the next sequence to finish. Training is a fluid pool: its slots
process the tokens of judged groups at their measured rate (CpuModel: only once judging ends, as
pivot_train.py does).

Where the cost model says so (CpuModel), slots are not independent: they share `cores` cores, so each
works max(1, busy / cores) times slower while `busy` slots work, and their engines tick in lockstep,
each tick as long as the slowest step plus the exchange with rank 0, with a prefill or a shift inside a
tick holding every engine. Then any change of one engine's batch re-times every engine, each keeping
the fraction of the step it is into.
"""
import heapq
import math
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

import planner
from roles import ENGINE_ROLES, ROLES
from sim.calibration import CostModel, Workload


@dataclass
class Slot:
    index: int
    role: str
    running: list[int] = field(default_factory=list)  # samples in its engine
    t: float = 0.0  # the time its engine's progress refers to
    step_s: float = 0.0  # seconds per engine step until its batch changes
    engine_s: float = 0.0  # of which the engine's own work (lockstep adds the tick's wait and exchange)
    ready_at: float = 0.0  # a shift in progress ends then
    shifted_at: float = -math.inf
    admitted_at: float = -math.inf  # the last instant it took work from its queue
    version: int = 0  # events scheduled under an older version are stale


@dataclass
class Result:
    placement: str
    slots: int
    seconds: float
    samples: int
    tokens: int
    shifts: int
    shift_seconds: float
    step_seconds: list[float]
    split: dict[str, int]
    slot_seconds: dict[str, float]  # by state: a role at work, "<role> idle", "shifting"; sums to slots x seconds
    phases: dict[str, float]  # summed over steps: until the last response, then the last verdict, then the end
    critical_path_s: float  # summed over steps: what no placement can beat (Simulation._critical_path)

    @property
    def busy_fraction(self) -> float:
        """Of all slot-seconds, those spent at work (an engine with sequences, a trainer with tokens):
        the rest is what moving slots between roles can fill."""
        return sum(self.slot_seconds.get(role, 0.0) for role in ROLES) / (self.slots * self.seconds)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds


class Step:
    """One step's samples: lengths drawn, and how far each has got. Phases: 0 queued for rollout,
    1 rolling out, 2 queued for the judge, 3 being judged, 4 judged."""

    def __init__(self, workload: Workload, rng: np.random.Generator):
        self.length, self.critique = workload.draw(rng)
        self.n, self.group_size, self.prompt = len(self.length), workload.group_size, workload.prompt_tokens
        self.judge_template = workload.judge_template_tokens
        self.gen = np.zeros(self.n, dtype=np.int64)  # response tokens generated
        self.cgen = np.zeros(self.n, dtype=np.int64)  # critique tokens written
        self.phase = np.zeros(self.n, dtype=np.int8)
        self.queue = {"rollout": deque(range(self.n)), "genrm": deque()}
        self.group_left = np.full(self.n // workload.group_size, workload.group_size)
        self.train_ready = self.train_done = 0.0
        self.generated = self.judged = 0

    def tokens(self, i) -> np.ndarray:
        return self.prompt + self.length[i]


class Simulation:
    def __init__(self, model: CostModel, workload: Workload, slots: int, placement: str, *, seed: int = 0,
                 config: planner.PlannerConfig | None = None, interval: float = 1.0, prior_steps: int = 1,
                 split: dict[str, int] | None = None):
        """`split`: disaggregated's slots per role; by default sized to each role's share of the work."""
        self.model, self.workload, self.placement = model, workload, placement
        self.rng = np.random.default_rng(seed)
        self.config, self.interval = config, interval
        self.speeds = model.planner_speeds(workload, slots)
        # Rank 0 refits each engine's speed from the steps it sees, as LoopPlanner does in pivot_train.py.
        self.fits = {role: planner.LinearFit(speed.step_s, speed.per_seq_s, hi=speed.max_seqs)
                     for role, speed in (("rollout", self.speeds.rollout), ("genrm", self.speeds.genrm))}
        self.costs = model.planner_costs(slots)
        self.split = {"rollout": slots}
        if placement == "disaggregated":
            self.split = split or self._split(slots)
            if sum(self.split.values()) != slots:
                raise ValueError(f"split {self.split} does not place {slots} slots")
        roles = [role for role, n in self.split.items() for _ in range(n)]
        self.slots = [Slot(i, role) for i, role in enumerate(roles)]
        self.now, self.events, self.counter = 0.0, [], 0
        self.shifts, self.shift_seconds = 0, 0.0
        self.slot_s = dict.fromkeys(ROLES + tuple(f"{r} idle" for r in ROLES) + ("shifting",), 0.0)
        self.phases = {"rollout": 0.0, "judge_tail": 0.0, "train_tail": 0.0}
        self.stalled = (-math.inf, 0.0)  # lockstep: the last instant engines were held, and for how long
        # What rank 0 knows of lengths before the step: earlier steps' draws (the first step's prior).
        seen = [workload.draw(self.rng) for _ in range(prior_steps)]
        self.lengths = planner.LengthEstimate(np.concatenate([s[0] for s in seen]), workload.max_response)
        self.critiques = planner.LengthEstimate(np.concatenate([s[1] for s in seen]), workload.max_critique)

    # -- the run ------------------------------------------------------------------------------------

    def run(self, steps: int) -> Result:
        step_seconds, samples, tokens, critical = [], 0, 0, 0.0
        for _ in range(steps):
            start = self.now
            step = Step(self.workload, self.rng)
            critical += self._critical_path(step)
            self._step(step)
            assert step.generated == step.judged == step.n and step.train_done == step.train_ready
            step_seconds.append(self.now - start)
            self.phases["rollout"] += self.rollout_end - start
            self.phases["judge_tail"] += self.judge_end - self.rollout_end
            self.phases["train_tail"] += self.now - self.judge_end
            samples += step.n
            tokens += int(step.length.sum())
            self.lengths = planner.LengthEstimate(step.length, self.workload.max_response)
            self.critiques = planner.LengthEstimate(step.critique, self.workload.max_critique)
        return Result(self.placement, len(self.slots), self.now, samples, tokens, self.shifts,
                      self.shift_seconds / max(self.shifts, 1), step_seconds, dict(self.split),
                      dict(self.slot_s), dict(self.phases), critical)

    def _step(self, step: Step) -> None:
        self.step, self.train_t, self.rollout_end = step, self.now, None
        self.events.clear()  # the last step's leftovers: stale by now
        if self.placement == "pivot":  # rank 0 plans before it hands out the step's work, as the loop does
            self._push(self.now, "plan", -1)
        for slot in self.slots:
            self._push(max(self.now, slot.ready_at), "engine", slot.index, slot.version)
        while step.judged < step.n:
            t, _, kind, s, version = heapq.heappop(self.events)
            assert t >= self.now - 1e-9, "the clock ran backwards"
            self._advance_train(t)
            self._account(t)
            self.now = max(self.now, t)
            if kind == "plan":
                self._plan()
                self._push(self.now + self.interval, "plan", -1)
            elif version == self.slots[s].version:
                self._touch(self.slots[s])
            if self.rollout_end is None and step.generated == step.n:
                self.rollout_end = self.now
            if self.placement == "colocated" and step.generated == step.n and self.slots[0].role == "rollout":
                for slot in self.slots:  # rollout is over everywhere: every slot judges
                    self._shift(slot, "genrm", 0)
        self.judge_end = self.now
        self._finish(step)

    def _finish(self, step: Step) -> None:
        """The rest of the update (colocated, pivot: on every slot), publishing, the rollout engines' reload."""
        everyone = self.placement != "disaggregated"
        if everyone:
            for slot in self.slots:
                self._shift(slot, "train", len(self.slots))
            self._advance_train(max(s.ready_at for s in self.slots))
        trainers = [s for s in self.slots if s.role == "train"]
        end = max([self.now] + [s.ready_at for s in trainers])
        self._account(end)
        self.now = end
        left, n = step.train_ready - step.train_done, len(trainers)
        # Nothing else works now: the trainers share the cores among themselves.
        end = self.now + left / (n * self.model.train_per_s(n)) * self.model.contention(n) + self.model.publish_seconds(n)
        self._account(end, training=True)
        self.now = end
        step.train_done = step.train_ready
        for slot in self.slots:
            slot.ready_at = max(slot.ready_at, self.now)
            if everyone:
                self._shift(slot, "rollout", 0)
            elif slot.role == "rollout":  # a reload of the new weights, not a change of role
                slot.ready_at = self.now + self.model.shift_seconds("rollout", "rollout", len(trainers))
        for slot in self.slots:
            slot.t, slot.version = slot.ready_at, slot.version + 1
        end = min(s.ready_at for s in self.slots)
        self._account(end)
        self.now = end

    def _critical_path(self, step: Step, block: int = 64) -> float:
        """A lower bound on the step, whatever the placement: its slowest sample generated and then
        judged alone, at batch 1, with no shift (in lockstep, each engine step a tick), then the update
        on every slot, of that sample's group where the cost model lets groups train early, else of all,
        and publishing. Each engine step is charged the context at the start of its block of `block`
        tokens (steps only grow with context); the candidates are the samples longest in response,
        critique and both."""
        m, n, g = self.model, len(self.slots), step.group_size
        # Lockstep engines pay the tick's exchange on every step, whatever the placement.
        tick = min(m.tick_seconds(p) for p in ("colocated", "disaggregated", "pivot")) if m.lockstep else 0.0

        def alone(role: str, context: int, tokens: int) -> float:
            return sum((m.step_seconds(role, 1, context + k) + tick) * min(block, tokens - k)
                       for k in range(0, tokens, block))

        top = lambda x: np.argsort(x)[-8:].tolist()  # noqa: E731
        candidates = set(top(step.length)) | set(top(step.critique)) | set(top(step.length + step.critique))
        judge_prompt = step.prompt + step.judge_template
        return max(step.prompt / m.prefill_per_s["rollout"] + alone("rollout", step.prompt, int(step.length[i]))
                   + (judge_prompt + step.length[i]) / m.prefill_per_s["genrm"]
                   + alone("genrm", judge_prompt + int(step.length[i]), int(step.critique[i]))
                   + float(step.tokens(slice(i // g * g, i // g * g + g) if m.early_train else slice(None)).sum())
                   / (n * m.train_per_s(n))
                   for i in candidates) + m.publish_seconds(n)

    # -- engines ------------------------------------------------------------------------------------

    def _touch(self, slot: Slot) -> None:
        """Brings the slot's engine to now: tokens generated, sequences finished, new ones admitted, and its
        next event scheduled."""
        if slot.role not in ENGINE_ROLES or self.now < slot.ready_at:
            return
        self._advance(slot)
        self._complete(slot)
        self._retime(slot, self._admit(slot))

    def _retime(self, touched: Slot | None, prefill: float = 0.0) -> None:
        """Sets the step time of the touched slot's engine and schedules its next event; where engines
        share cores or tick together, of every running engine. `prefill`: seconds the touched engine
        spends taking in new requests first (uncontended)."""
        shared = self.model.cores is not None or self.model.lockstep
        running = [s for s in self.slots if s.role in ENGINE_ROLES and s.running and s.ready_at <= self.now]
        slots = running if shared else [s for s in [touched] if s is not None and s.running]
        share = self.model.contention(self._busy())
        step_s = {s.index: share * self.model.step_seconds(s.role, len(s.running), self._context(s.role, s.running))
                  for s in slots}
        engine_s = dict(step_s)
        if self.model.lockstep and step_s:  # one step per engine per tick; a tick waits for the slowest
            step_s = dict.fromkeys(step_s, max(step_s.values()) + self.model.tick_seconds(self.placement))
        for s in slots:
            if s is not touched:
                self._advance(s)  # whole steps at its old speed
            if shared and s.step_s and s.t < self.now:  # the fraction of a step it is into carries over
                s.t = self.now - (self.now - s.t) / s.step_s * step_s[s.index]
            s.step_s, s.engine_s = step_s[s.index], engine_s[s.index]
        if prefill and self.model.lockstep:
            self._stall(share * prefill)
        elif prefill:
            touched.t += share * prefill
        if touched is not None:
            touched.version += 1
        for s in slots:
            if s is not touched:
                s.version += 1
            left = int((self._target(s.role, s.running) - self._progress(s.role)[s.running]).min())
            self._push(max(self.now, s.t + left * s.step_s), "engine", s.index, s.version)

    def _account(self, t: float, training: bool = False) -> None:
        """Each slot's seconds from now to t, by state (nothing changes state in between but the end of
        a shift). `training`: the step's last update, on the train slots, with nothing else at work."""
        for s in self.slots:
            shifting = min(max(s.ready_at - self.now, 0.0), max(t - self.now, 0.0))
            self.slot_s["shifting"] += shifting
            # Early training counts as idle here; _advance_train moves the seconds it worked to "train".
            working = training if s.role == "train" else bool(s.running) and not training
            self.slot_s[s.role if working else f"{s.role} idle"] += max(t - self.now, 0.0) - shifting

    def _busy(self) -> int:
        """Slots working now: engines with sequences, train slots with judged groups to train on."""
        step = self.step
        return sum(s.ready_at <= self.now and (bool(s.running) if s.role in ENGINE_ROLES else
                                               self.model.early_train and step.train_ready > step.train_done)
                   for s in self.slots)

    def _stall(self, seconds: float) -> None:
        """Lockstep: work inside a tick (a rank's prefill; a shift, since apply is collective) holds every
        engine. Such work of several ranks at one instant runs side by side: the tick grows by the longest."""
        at, longest = self.stalled
        extra = max(0.0, seconds - longest) if at == self.now else seconds
        self.stalled = (self.now, max(seconds, longest) if at == self.now else seconds)
        for s in self.slots:
            if s.role in ENGINE_ROLES and s.running:
                s.t += extra

    def _advance(self, slot: Slot) -> None:
        """Whole engine steps up to now; the engine's time stays at the last step's end, so a slot
        touched often loses no fraction of a step."""
        if not slot.running:
            slot.t = max(slot.t, self.now)
            return
        progress = self._progress(slot.role)
        left = int((self._target(slot.role, slot.running) - progress[slot.running]).min())
        steps = min(left, max(0, int((self.now - slot.t) / slot.step_s + 1e-9)))
        progress[slot.running] += steps
        slot.t += steps * slot.step_s

    def _complete(self, slot: Slot) -> None:
        step = self.step
        done = [i for i in slot.running if self._progress(slot.role)[i] >= self._target(slot.role, i)]
        slot.running = [i for i in slot.running if i not in set(done)]
        for i in done:
            if slot.role == "rollout":
                assert step.phase[i] == 1, f"sample {i} generated twice"
                step.phase[i], step.generated = 2, step.generated + 1
                step.queue["genrm"].append(i)
            else:
                assert step.phase[i] == 3, f"sample {i} judged twice"
                step.phase[i], step.judged = 4, step.judged + 1
                group = i // step.group_size
                step.group_left[group] -= 1
                if step.group_left[group] == 0:
                    members = slice(group * step.group_size, (group + 1) * step.group_size)
                    step.train_ready += float(step.tokens(members).sum())
        if done and slot.role == "rollout":
            self._offer("genrm", slot)

    def _admit(self, slot: Slot) -> float:
        """Takes queued work up to the engine's room and a fair share of the queue, as the scheduler's
        dispatch does, so that migrated sequences spread over the role's engines; returns the seconds
        their prefill takes. The share is of the engines not yet served at this instant: those touched
        one after another at one instant split the queue evenly, as one dispatch would."""
        queue, prefill = self.step.queue[slot.role], 0.0
        engines = sum(s.role == slot.role and s.ready_at <= self.now and s.admitted_at != self.now
                      for s in self.slots)
        take = min(self.model.max_seqs[slot.role] - len(slot.running), -(-len(queue) // max(engines, 1)))
        if take > 0:
            slot.admitted_at = self.now
        for _ in range(take):
            i = queue.popleft()
            self.step.phase[i] = 1 if slot.role == "rollout" else 3
            slot.running.append(i)
            # A resumed sequence prefills what it had generated too.
            prefill += self._context(slot.role, [i])
        return prefill / self.model.prefill_per_s[slot.role]

    def _progress(self, role: str) -> np.ndarray:
        return self.step.gen if role == "rollout" else self.step.cgen

    def _target(self, role: str, i):
        return self.step.length[i] if role == "rollout" else self.step.critique[i]

    def _context(self, role: str, running: list[int]) -> float:
        step = self.step
        if role == "rollout":
            return float(len(running) * step.prompt + step.gen[running].sum())
        return float(len(running) * (step.prompt + step.judge_template) + step.length[running].sum()
                     + step.cgen[running].sum())

    # -- training -----------------------------------------------------------------------------------

    def _advance_train(self, t: float) -> None:
        """The train slots' work from the last event to t, on judged groups only."""
        if t <= self.train_t:
            return
        step = self.step
        trainers = [s for s in self.slots if s.role == "train"]
        if self.model.early_train and trainers:
            seconds = sum(max(0.0, t - max(self.train_t, s.ready_at)) for s in trainers)
            rate = self.model.train_per_s(len(trainers)) / self.model.contention(self._busy())
            worked = min(seconds, (step.train_ready - step.train_done) / rate)  # until the judged groups run out
            self.slot_s["train"] += worked
            self.slot_s["train idle"] -= worked
            step.train_done = min(step.train_ready, step.train_done + seconds * rate)
        self.train_t = t

    # -- shifts -------------------------------------------------------------------------------------

    def _plan(self) -> None:
        for s in self.slots:
            if s.role in ENGINE_ROLES and s.running and s.ready_at <= self.now:
                self.fits[s.role].observe(len(s.running), s.engine_s)
        speeds = replace(self.speeds, **{role: replace(getattr(self.speeds, role), step_s=fit.fit()[0],
                                                        per_seq_s=fit.fit()[1]) for role, fit in self.fits.items()})
        ranks = [planner.Rank(s.role, int(self._context(s.role, s.running)) if s.role in ENGINE_ROLES else 0,
                              self.now - s.shifted_at) for s in self.slots]
        moves = planner.plan(ranks, self._work(), speeds, self.costs, self.config)
        train_after = sum(r == "train" for r in planner.apply_moves([s.role for s in self.slots], moves))
        for move in moves:
            self._shift(self.slots[move.rank], move.dst, train_after)
        for move in moves:
            self._touch(self.slots[move.rank])

    def _shift(self, slot: Slot, role: str, train_slots: int) -> None:
        """Moves a slot to `role`: its running sequences go back to the head of their queue (migration)."""
        if slot.role == role and role != "train":
            return
        old = slot.role
        if slot.role in ENGINE_ROLES:
            self._advance(slot)
            queue = self.step.queue[slot.role]
            for i in reversed(slot.running):
                self.step.phase[i] = 0 if slot.role == "rollout" else 2
                queue.appendleft(i)
            slot.running = []
        if slot.role != role:
            seconds = self.model.shift_seconds(slot.role, role, train_slots)
            self.shifts, self.shift_seconds = self.shifts + 1, self.shift_seconds + seconds
            slot.role, slot.shifted_at = role, self.now
            slot.ready_at = max(slot.ready_at, self.now) + seconds
            slot.version += 1
            self._push(slot.ready_at, "engine", slot.index, slot.version)
        if old in ENGINE_ROLES:
            self._offer(old, slot)
        if self.model.lockstep and old != role:
            self._stall(seconds)
        if self.model.cores is not None or self.model.lockstep:
            self._retime(None)  # one engine fewer at work

    def _offer(self, role: str, source: Slot) -> None:
        """Queued work reaches the role's engines that have room, now rather than at their next event."""
        room = [s for s in self.slots if s.role == role and s is not source and s.ready_at <= self.now
                and len(s.running) < self.model.max_seqs[role]]
        for other in sorted(room, key=lambda s: len(s.running)):  # the least loaded first
            if not self.step.queue[role]:
                return
            self._touch(other)

    def _work(self) -> planner.Work:
        step, w = self.step, self.workload
        rolling = np.flatnonzero(step.phase <= 1)
        judging = np.flatnonzero(step.phase == 3)
        waiting = len(step.queue["genrm"])
        tokens = self.lengths.remaining(step.gen[rolling]) if len(rolling) else np.zeros(0)
        queued = list(step.queue["rollout"])
        return planner.Work(
            rollout_seqs=len(rolling), rollout_tokens=float(tokens.sum()),
            rollout_longest=self.lengths.longest(int(step.gen[rolling].min())) if len(rolling) else 0.0,
            rollout_prefill=float(len(queued) * step.prompt + step.gen[queued].sum()),
            judge_seqs=len(judging) + waiting,
            judge_tokens=float(self.critiques.remaining(step.cgen[judging]).sum()) + waiting * self.critiques.mean(),
            judge_longest=self.critiques.longest(int(step.cgen[judging].min()) if len(judging) else 0)
            if len(judging) or waiting else 0.0,
            judge_prefill=float(sum(step.prompt + step.judge_template + step.length[i] for i in step.queue["genrm"])),
            critique_tokens=self.critiques.mean(),
            judge_prompt_tokens=w.prompt_tokens + w.judge_template_tokens + self.lengths.mean(),
            train_ready=step.train_ready - step.train_done,
            train_tokens=float(step.tokens(np.arange(step.n)).sum()) - step.train_done)

    def _split(self, slots: int) -> dict[str, int]:
        """Disaggregated: slots per role in proportion to each role's slot-seconds of work in a step at
        the expected lengths (the planner's own model), each role at least what it needs."""
        n, s = self.workload.prompts * self.workload.group_size, self.speeds
        lengths, critiques = self.workload.draw(np.random.default_rng(0))
        rollout = planner.engine_seconds(s.rollout, 1, n, float(lengths.sum()), 0.0, n * self.workload.prompt_tokens)
        judge = planner.engine_seconds(s.genrm, 1, n, float(critiques.sum()), 0.0, float(lengths.sum())
                                       + n * (self.workload.prompt_tokens + self.workload.judge_template_tokens))
        train = float(n * self.workload.prompt_tokens + lengths.sum()) / s.train_per_s
        total = rollout + judge + train
        t = max(self.model.min_train_slots, round(slots * train / total))
        g = max(1, round(slots * judge / total))
        if slots - t - g < 1:
            raise ValueError(f"{slots} slots cannot hold a disaggregated split: train needs {t}, the judge {g}, "
                             f"rollout 1; simulate more devices")
        return {"rollout": slots - t - g, "genrm": g, "train": t}

    def _push(self, t: float, kind: str, slot: int, version: int = 0) -> None:
        self.counter += 1
        heapq.heappush(self.events, (t, self.counter, kind, slot, version))
