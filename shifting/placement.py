"""Where each role runs (`--placement`): the roles a step starts with, each round's roles while it rolls
out and judges (`next_roles`: the one place that decides them), and the ranks that train at its end. The
algorithm is the same in every placement.

  colocated      every rank rolls out, then every rank judges, then every rank trains
  disaggregated  a fixed `--split` of ranks per role; responses stream to the judge ranks
  pivot          the planner (planner.py) moves ranks between roles while the step runs
`--force-shifts SEED` replaces any placement's roles by a seeded random schedule of moves, to exercise
migration.
"""
from collections.abc import Callable
from dataclasses import dataclass

from planner import EngineSpeed, LengthEstimate, LoopPlanner, PlannerConfig, Speeds, TrainSpeed, update_seconds
from roles import ROLES, Role
from shifting import book
from shifting.scheduler import Rounds, colocated_roles, forced_roles


@dataclass(frozen=True)
class PlacementOptions:
    """What a placement is given, from pivot_train.py's flags (checked there, in `check_placement`)."""
    placement: str  # --placement: colocated, disaggregated or pivot
    split: tuple[Role, ...] | None  # --split, parsed: each rank's role, in rank order (disaggregated; else None)
    max_staleness: int  # --max-staleness K: the update trains the groups of the step K earlier (0: this step's)
    force_shifts: int | None  # --force-shifts SEED: a seeded random schedule of moves; None: the placement's roles
    force_shift_rate: float  # --force-shift-rate: with --force-shifts, the chance of a move at each engine step
    minibatches: int  # --minibatches: optimizer steps per RL step (early training takes one)
    max_seqs: int  # --max-seqs: sequences in flight per engine (the planner's prior of an engine's room)
    max_response_tokens: int  # --max-response-tokens: the longest response, before the planner has seen any
    max_critique_tokens: int  # --max-critique-tokens: the longest critique, likewise
    seed: int  # --seed: seeds a step's random choices of roles, unless --force-shifts gives its own


class Placement:
    def __init__(self, options: PlacementOptions, world_size: int):
        self.options, self.world_size = options, world_size
        # Early training: the planner may move ranks to train on judged groups while the step still
        # rolls out and judges; the optimizer steps once every group is in, so the update is the same.
        # One minibatch only: a later minibatch's gradients need the weights its predecessor updates.
        # With --max-staleness > 0 the groups are an earlier step's, so a fixed split's train ranks too
        # work through them while the others roll out and judge. --force-shifts trains early at K > 0 only,
        # where a train rank it picks works through the earlier step's groups all in the round it is handed
        # them (its rounds are untimed), so its schedule still depends on its seed alone.
        overlaps = options.placement == "pivot" or (options.placement == "disaggregated" and options.max_staleness > 0)
        self.early_train = overlaps and (options.force_shifts is None or options.max_staleness > 0) \
            and options.minibatches == 1
        self.planner = None
        if options.placement == "pivot":
            # Priors only: the planner refits engine speeds every round and shift costs every step.
            engine = EngineSpeed(step_s=0.01, per_seq_s=1e-4, prefill_per_s=1e4, max_seqs=options.max_seqs)
            self.planner = LoopPlanner(Speeds(engine, engine, train_per_s=TrainSpeed.PRIOR),
                                       # a shift between roles, and a train group's reshard
                                       {(a, b): 0.01 for a in ROLES for b in ROLES if a != b or a == Role.TRAIN},
                                       LengthEstimate([], options.max_response_tokens),
                                       LengthEstimate([], options.max_critique_tokens),
                                       PlannerConfig(early_train=self.early_train, min_train_ranks=1))
        # The run's one estimate of the training speed (the pivot planner's, where there is one): every
        # early train round measures it (StepQueues.ingest), and each update of a pivot run (`learn`).
        self.train_speed = self.planner.train if self.planner else TrainSpeed()

    @property
    def seed(self) -> int:
        """What seeds each step's random choices of roles (`next_roles`' rng): --force-shifts' SEED, so that its
        schedule of moves depends on it alone, else --seed."""
        return self.options.seed if self.options.force_shifts is None else self.options.force_shifts

    def start_roles(self) -> list[str]:
        return list(self.options.split) if self.options.split else [Role.ROLLOUT] * self.world_size

    def step_roles(self, held: list[str]) -> list[str]:
        """The roles the next step begins with, from those the ranks `held` as this step's rounds ended
        (book.next_step_roles): pivot's at --max-staleness K > 0 without --force-shifts, else `start_roles`."""
        planned = self.planner is not None and self.options.force_shifts is None
        return book.next_step_roles(held, self.start_roles(), planned, self.options.max_staleness)

    def train_roles(self, roles: list[str], alone: bool) -> list[str]:
        """Who makes the update after the step's rounds (book.update_roles): disaggregated's split (its train
        ranks train, the others wait); colocated and pivot on every rank, but pivot's train ranks (`roles`)
        alone where rank 0 found that no slower (`update_alone`)."""
        return book.update_roles(roles, self.options.split, alone)

    def most_train_ranks(self) -> int:
        """The most ranks that make an update together: a split's train ranks, else every rank."""
        return self.train_roles([Role.ROLLOUT] * self.world_size, alone=False).count(Role.TRAIN)

    def update_alone(self, roles: list[str], queues) -> bool:
        """Rank 0, once the step's rounds are over: whether the train ranks make the update alone
        (planner.update_seconds), from the groups they have not trained (rank 0's `queues`), the run's
        training speed and the shifts' costs the planner has measured. Only where they trained early: a
        train rank holds nothing of an update otherwise."""
        if self.planner is None or not self.early_train:
            return False
        left = queues.update_book.train_work()[0] / self.train_speed.per_s
        return update_seconds(left, roles, self.planner.costs)[1]

    def capacity(self, role: str, seqs: int, seconds: float | None) -> int:
        """The most sequences an engine of `role` takes in for a round of `seconds` (None: untimed), given
        the role's `seqs` queued and running: its room (--max-seqs), but pivot's judge engines only as many
        as they step well or finish within the round (book.intake, from the planner's fit of their steps),
        so that responses they would crowd in wait for the ranks that join the judge."""
        if self.planner is None:
            return self.options.max_seqs
        return self.planner.capacity(role, seqs, self.world_size, seconds)

    def budget(self, role: str, seconds: float | None,
               rollout_running: Callable[[], list[list[int]]]) -> float | None:
        """The context tokens of new work an engine of `role` takes in a round of `seconds` (None: untimed):
        at K = 0 pivot's judge engines only what they prefill in the round (book.prefill_budget, at the
        planner's measured prefill speed), so that work waits at rank 0 for the ranks that join the judge,
        and no more than they prefill before the rollout engines running `rollout_running()` (the tokens
        generated by each one's sequences; none while prompts wait for rollout; called only where the
        budget applies) are expected to run empty."""
        if self.planner is None:
            return None
        return book.prefill_budget(role, self.options.max_staleness == 0, seconds, self.planner.prefill_per_s(role),
                                   until_empty_s=lambda: self.planner.first_empty(rollout_running(), self.world_size))

    def next_roles(self, roles: list[str], queues, rng) -> tuple[list[str], Rounds]:
        """The roles from now on, and how long the ranks work before they next report: --force-shifts'
        random moves, pivot's plan (planner.py), a split's own roles, or colocated's turn of every rank."""
        if self.options.force_shifts is not None:
            return forced_roles(roles, queues, rng, self.options.force_shift_rate)
        if self.planner is not None:
            return self.planner(roles, queues, rng), queues.timed_round()
        if self.options.split:
            return roles, queues.timed_round()
        return colocated_roles(roles, queues, rng)

    def state(self) -> dict | None:
        return self.planner.state() if self.planner else None

    def load_state(self, state: dict | None) -> None:
        if self.planner is not None and state is not None:
            self.planner.load_state(state)

    def learn(self, samples, shifts: list[dict], stats: dict) -> None:
        """The pivot planner's view of the next step: this step's lengths, the training speed and the
        measured shift costs."""
        if self.planner is None:
            return
        if "train_tokens_per_s" in stats:  # measured in a step that trained something
            self.train_speed.observe(stats["train_tokens_per_s"])
        self.planner.lengths = LengthEstimate([len(s.response_ids) for s in samples], self.options.max_response_tokens)
        self.planner.critiques = LengthEstimate([s.critique_tokens for s in samples], self.options.max_critique_tokens)
        for shift in shifts:
            key = (shift["from"], shift["to"])
            if key in self.planner.costs:
                self.planner.costs[key] = 0.5 * self.planner.costs[key] + 0.5 * shift["seconds"]
