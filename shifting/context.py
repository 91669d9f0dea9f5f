"""The unified role context: one mechanism moves a rank from any role (rollout, judge, train) to any
other, and reshards the train group when its membership changes.

A shift of a rank from role A to role B always runs these stages, in this order (verl's order for a
rollout/trainer switch, which is the one that works on GPUs):

  1. drain    A's engine must hold no in-flight sequence (the scheduler migrates them first); its cached
              KV blocks are freed.
  2. offload  A's context goes: an engine discards its weights and KV cache (vLLM sleep, level 2: the
              storage holds the weights); the train role writes its master shards and AdamW moments to
              storage and frees its module and optimizer (on GPU). A's RNG state is kept for its return.
  3. onload   B's context comes from storage: an engine wakes its weights, loads the latest published
              version, then wakes its KV cache (so the cache's memory is claimed after the weights');
              the train role builds its FSDP2 module over the new train group and loads its rows.
  4. ready    B's RNG state is restored.

On GPU only the policy's engine sleeps (vLLM allows one sleep-mode engine per process); the judge's engine
keeps its weights and KV cache on the device, so it loads, like an engine on CPU, only a newer version.
On CPU, vLLM's sleep and wake are no-ops: an engine keeps its weights and KV cache in host memory while
its rank holds another role (rebuilding an engine costs ~10 s), and onload reloads its weights from
storage only when a newer version was published since it last loaded (the policy after an update; the
frozen judge loads once). Likewise the trainer stays allocated on CPU (freeing host memory only to
fault it back in costs more than the copy) and its onload, when the train group is unchanged, copies
the stored state into it; a changed group builds a new one.

An engine whose rank keeps its role still loads each newly published version at the next `apply` (a
disaggregated rollout rank after every update), reported as a rollout -> rollout shift of its onload.

An engine asleep when its rank already holds its role (a policy engine created asleep, at the first
`apply`) onloads like an arriving one.

`apply` is collective: every rank passes the same assignment. Writing the train state and making the
new train group involve every rank, so a train rank that stays while the group changes is resharded
too, and reported as a train -> train shift. Train groups other than the whole world are kept for the
current and the previous train group only (a group A, then B, then A again reuses A); older ones are
destroyed on every rank in the same order, since each NCCL communicator holds device memory.

Engines may be None (checks of the train role alone, such as bench/gpu_check.py): their roles then hold
nothing to move.
"""
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

import faults
from roles import ROLES, Role
from runtime import Dist
from shifting import book

STAGES = ("drain", "offload", "onload", "ready")
KEPT_GROUPS = 2  # the current train group and the previous one


class RoleContext:
    """This rank's role and what it holds for it: the two engines (kept, see above) and, while it
    trains, the trainer. `make_trainer(group)` builds a trainer from the training state in storage.
    `groups`: the train groups kept, least recently used first. `observer.shifted(record, start)`, if
    given, hears of each shift this rank makes (timeline.py)."""

    def __init__(self, d: Dist, roles: list[str], *, policy, judge, train_state, rollout_engine,
                 judge_engine, make_trainer, observer=None):
        assert len(roles) == d.slots and set(roles) <= set(ROLES), roles
        self.d, self.roles = d, list(roles)  # each slot's role (--engine-tp ranks; one rank at 1)
        self.storage = {Role.ROLLOUT: policy, Role.JUDGE: judge}
        self.engines = {Role.ROLLOUT: rollout_engine, Role.JUDGE: judge_engine}
        self.train_state, self.make_trainer, self.observer = train_state, make_trainer, observer
        self.groups, self.rng = {}, {}
        self.loaded = {Role.ROLLOUT: None, Role.JUDGE: None}  # the version each engine holds (None: from disk)
        self.parked = None  # CPU: the trainer kept allocated while this rank holds another role
        train = train_ranks(self.roles, d.slot_size)
        group = self._group(train) if train else None
        self.trainer = make_trainer(group) if self.role == Role.TRAIN else None

    @property
    def role(self) -> str:
        return self.roles[self.d.slot]

    def apply(self, roles: list[str], gather: bool = True) -> list[dict]:
        """Moves every slot's ranks to the slot's role in `roles` (every rank passes the same: a slot is
        --engine-tp ranks, book.slot_ranks, and its ranks shift together); returns each shifted
        rank's record {rank, from, to, seconds, drain, offload, onload, ready, bytes}, the same on every
        rank. Collective where the train group changes (the state is saved, a group made) and to gather
        the records; with `gather` False, a shift between engine roles is this rank's alone (no rank waits
        for another's) and only this rank's record comes back."""
        assert len(roles) == self.d.slots and set(roles) <= set(ROLES), roles
        size = self.d.slot_size
        old, new = self.role, roles[self.d.slot]
        regroup = train_ranks(roles, size) != train_ranks(self.roles, size)
        moving = old != new or (regroup and new == Role.TRAIN)
        # An engine that keeps its role still loads a newer published version (disaggregated rollout),
        # and one still asleep wakes (a policy engine created asleep).
        engine = self.engines.get(new)
        refresh = not moving and engine is not None and (engine.asleep or self._stale(new))
        seconds, moved = {}, 0
        start = self.observer.now() if self.observer else 0.0
        with stage(seconds, "drain"):
            if moving and self.engines.get(old) is not None:
                self.engines[old].drain()
        with stage(seconds, "offload"):
            # Every rank takes part; the train ranks write their rows. With no train rank yet there is
            # nothing to save (and a save in which no rank writes leaves storage as it is).
            if regroup and train_ranks(self.roles, size):
                self.train_state.save(self.trainer)
            if moving:
                self._offload(old)
                faults.point("shift", self.d.rank)
        with stage(seconds, "onload"):
            group = self._group(train_ranks(roles, size)) if regroup and Role.TRAIN in roles else None
            if moving:
                moved = self._onload(new, group)
            elif refresh:
                moved = self._onload(new, None)
        with stage(seconds, "ready"):
            if moving and new in self.rng:
                set_rng_state(self.rng.pop(new))
        self.roles = list(roles)
        record = None
        if moving or refresh:
            record = {"rank": self.d.rank, "from": old, "to": new, "seconds": sum(seconds.values()),
                      **seconds, "bytes": moved}
            if self.observer:
                self.observer.shifted(record, start)
        if not gather:  # the caller collects the records its own way (the scheduler, in its reports)
            return [record] if record else []
        records = [None] * self.d.world_size
        dist.all_gather_object(records, record, group=self.d.control)
        return [r for r in records if r is not None]

    def _offload(self, role: str) -> None:
        self.rng[role] = get_rng_state()
        if role == Role.TRAIN:  # its state is in storage already: apply saved it
            if self.d.device.type == "cpu":
                self.parked = self.trainer
            else:
                self.trainer.close()
            self.trainer = None
        elif self.engines[role] is not None:
            self.engines[role].sleep()

    def _onload(self, role: str, group) -> int:
        """Loads `role`'s context; returns the bytes read from storage."""
        if role == Role.TRAIN:
            if self.parked is not None and self.parked.group is group:
                self.trainer = self.parked
                self.trainer.reload()
            else:
                self.trainer = self.make_trainer(group)
            self.parked = None
            return sum(rows.numel() * rows.element_size() for _, rows, _ in self.trainer.state_rows())
        engine = self.engines[role]
        if engine is None:
            return 0
        # Asleep (GPU, sleep mode), an engine discarded its weights; otherwise it kept them, and loads only
        # a newer version.
        discarded = engine.asleep
        engine.wake_weights()
        moved = self._load(role) if discarded or self._stale(role) else 0
        engine.wake_kv_cache()
        return moved

    def _stale(self, role: str) -> bool:
        """Whether storage holds a version of `role`'s model other than the one its engine last loaded."""
        return self.loaded[role] != self.storage[role].version

    def _load(self, role: str) -> int:
        """The latest published version of `role`'s model into its engine; returns the bytes read."""
        loaded = self.storage[role].load_into(self.engines[role])
        self.loaded[role] = self.engines[role].version = loaded["version"]
        return loaded["bytes"]

    def _group(self, ranks: list[int]):
        """The process group of `ranks`; collective, so every rank asks in the same order. A group no
        longer kept is destroyed before a new one is made, so a rank holds at most KEPT_GROUPS of them."""
        if len(ranks) == self.d.world_size:
            return self.d.tensors
        key = tuple(ranks)
        if key in self.groups:
            self.groups[key] = self.groups.pop(key)  # now the most recently used
            return self.groups[key]
        while len(self.groups) >= KEPT_GROUPS:
            self._destroy(next(iter(self.groups)))
        self.groups[key] = dist.new_group(list(ranks))
        return self.groups[key]

    def _destroy(self, key: tuple[int, ...]) -> None:
        """Destroys a kept group on every rank (a rank outside it destroys nothing). Neither the trainer
        (its group is the newest) nor, on CPU, a parked trainer of that group ever uses it again."""
        group = self.groups.pop(key)
        if self.parked is not None and self.parked.group is group:
            self.parked = None
        dist.destroy_process_group(group)


def get_rng_state():
    return torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None


def set_rng_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def train_ranks(roles: list[str], slot_size: int) -> list[int]:
    """The ranks of the train slots: one FSDP2 group."""
    return [rank for rank, role in enumerate(book.rank_roles(roles, slot_size)) if role == Role.TRAIN]


@contextmanager
def stage(seconds: dict, name: str):
    start = time.perf_counter()
    yield
    seconds[name] = time.perf_counter() - start
