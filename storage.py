"""Global Parameter Storage: the one place every role loads model weights from.

Per node, each model has one flat buffer in host shared memory (/dev/shm) holding its latest published
version. The trainer publishes a version once per step; every local rank's engine then loads its
weights from views into that buffer, so a node keeps one copy however many ranks it runs. Every node
holds its own replica, written by its local rank 0. The file is unlinked as soon as every local rank
has mapped it, so nothing is left behind in /dev/shm, even by a run that crashes.
"""
import os
import time
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime import Dist

_ALIGN = 64
_HEADER = 64  # bytes before the first tensor: the published version as int64


@dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


def plan_layout(shapes: list[tuple[str, tuple[int, ...], torch.dtype]]) -> tuple[list[Slot], int]:
    """Place tensors back to back, each aligned, after the header; returns the slots and total bytes."""
    slots, offset = [], _HEADER
    for name, shape, dtype in shapes:
        slots.append(Slot(name, tuple(shape), dtype, offset))
        offset += -(-_numel(shape) * dtype.itemsize // _ALIGN) * _ALIGN
    return slots, offset


class ParameterStorage:
    """One model's published weights, shared by the local ranks of a node."""

    def __init__(self, d: Dist, model: str, shapes: list[tuple[str, tuple[int, ...], torch.dtype]]):
        self.d = d
        self.slots, self.nbytes = plan_layout(shapes)
        run_id = [uuid.uuid4().hex[:12] if d.rank == 0 else None]
        dist.broadcast_object_list(run_id, src=0, group=d.control)
        self.path = f"/dev/shm/pivotrl-{run_id[0]}-node{d.node}-{model}"
        if d.local_rank == 0:
            with open(self.path, "wb") as f:
                f.truncate(self.nbytes)
        dist.barrier(group=d.control)
        self.buffer = torch.from_file(self.path, shared=True, size=self.nbytes, dtype=torch.uint8)
        dist.barrier(group=d.control)
        # Every local rank has mapped the buffer: the name can go, so a crashed run leaks nothing.
        if d.local_rank == 0:
            os.unlink(self.path)
        self._version = self.buffer[:8].view(torch.int64)
        self.views = {s.name: self._view(s) for s in self.slots}
        self.last_publish = {}

    def _view(self, slot: Slot) -> torch.Tensor:
        return self.buffer[slot.offset:slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)

    @property
    def version(self) -> int:
        return int(self._version.item())

    def publish(self, named_tensors, version: int) -> None:
        """Collective over all ranks: each node's local rank 0 writes the full tensors it is handed.

        `named_tensors` is iterated on every rank (it may gather shards, which is collective)."""
        start, moved = time.perf_counter(), 0
        # No rank may still be reading the previous version while it is overwritten.
        dist.barrier(group=self.d.control)
        for name, tensor in named_tensors:
            if self.d.local_rank == 0:
                self.views[name].copy_(tensor)
                moved += tensor.numel() * tensor.element_size()
        if self.d.local_rank == 0:
            self._version.fill_(version)
        dist.barrier(group=self.d.control)
        self.last_publish = {"version": version, "bytes": moved, "seconds": time.perf_counter() - start}

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Zero-copy views of the published version, in layout order."""
        return [(s.name, self.views[s.name]) for s in self.slots]

    def close(self) -> None:
        """Drops this rank's mapping; the memory is freed when the node's last rank lets go."""
        self.views, self.buffer, self._version = {}, None, None


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
