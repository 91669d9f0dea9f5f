"""Global Parameter Storage: the one place every role loads its weights and training state from.

Per node, each stored thing (the policy's published weights, the judge's weights, the policy's training
state) is one flat buffer in host shared memory (/dev/shm) holding its latest version, so a node keeps
one copy however many ranks it runs. Every node holds its own replica: a sharded publish sends each
rank's rows to the other nodes once, over the tensor backend, from the rank that wrote them. The file is
unlinked as soon as every local rank has mapped it, so nothing is left behind in /dev/shm, even by a run
that crashes.

Everything is stored full-shaped, never per rank: an FSDP2 rank writes and reads the rows of dim 0 that
its Shard(0) holds (`shard_rows`) for whatever group it is in, so a train group that shrinks or grows
loads the same state it left. On CUDA nodes the buffers are pinned (page-locked) for fast host-device
copies, and `share_on_device` keeps one device-resident copy per node that the other local ranks map
through CUDA IPC handles.
"""
import glob
import math
import os
import time
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime import Dist

_ALIGN = 64
_HEADER = 64  # bytes before the first tensor: the published version as int64
# Rows cross nodes in pieces of at most this many bytes, so the staging buffer on each side stays small
# (a 30B policy's training state is ~360 GB) while each piece is still large enough to run at link speed.
_PIECE = 64 << 20
TRAFFIC = ("publishes", "bytes", "bytes_local", "bytes_across_nodes", "seconds")


@dataclass(frozen=True)
class Region:
    """Where one named tensor lies in a storage buffer."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def layout(shapes: list[tuple[str, tuple[int, ...], torch.dtype]]) -> tuple[list[Region], int]:
    """Place tensors back to back, each aligned, after the header; returns the regions and total bytes."""
    regions, offset = [], _HEADER
    for name, shape, dtype in shapes:
        regions.append(Region(name, tuple(shape), dtype, offset))
        offset += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
    return regions, offset


def pieces(sizes: list[int], limit: int):
    """The runs of bytes `sizes`, laid end to end, cut into pieces of at most `limit` bytes; yields each
    piece as its (run, start, stop) byte ranges, in order. Empty runs appear in no piece."""
    piece, room = [], limit
    for run, size in enumerate(sizes):
        at = 0
        while at < size:
            take = min(size - at, room)
            piece.append((run, at, at + take))
            at, room = at + take, room - take
            if room == 0:
                yield piece
                piece, room = [], limit
    if piece:
        yield piece


def pack(piece, sources: list[torch.Tensor], staged: torch.Tensor) -> None:
    """The piece's byte ranges of `sources`, end to end into `staged`."""
    at = 0
    for run, begin, stop in piece:
        staged[at:at + stop - begin].copy_(sources[run][begin:stop])
        at += stop - begin


def unpack(piece, staged: torch.Tensor, targets: list[torch.Tensor]) -> None:
    """`staged`, end to end, into the piece's byte ranges of `targets` (pinned host memory on GPU: the
    copies run asynchronously; the caller synchronizes)."""
    at = 0
    for run, begin, stop in piece:
        targets[run][begin:stop].copy_(staged[at:at + stop - begin], non_blocking=True)
        at += stop - begin


def as_bytes(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`rows` in `dtype`, flat, viewed as bytes (a view when they are contiguous in that dtype already)."""
    return rows.detach().to(dtype).contiguous().view(-1).view(torch.uint8)


def shard_rows(rows: int, index: int, count: int) -> tuple[int, int]:
    """Rows [start, stop) of dim 0 held by shard `index` of `count` under FSDP2's Shard(0), which splits
    like torch.chunk: ceil-sized chunks, so the last shards may be shorter or empty."""
    size = -(-rows // count)
    return min(index * size, rows), min((index + 1) * size, rows)


class ParameterStorage:
    """Named full-shaped tensors in one buffer per node, mapped by every local rank."""

    def __init__(self, d: Dist, model: str, shapes: list[tuple[str, tuple[int, ...], torch.dtype]]):
        self.d = d
        self.regions, self.nbytes = layout(shapes)
        self.region = {s.name: s for s in self.regions}
        self.index = {s.name: i for i, s in enumerate(self.regions)}
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
        dist.barrier(group=d.control)  # so the name is gone on every rank once this returns
        if torch.cuda.is_available():
            # Page-locked, so host<->device copies run by DMA at full link speed.
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.nbytes, 0))
        self._version = self.buffer[:8].view(torch.int64)
        self.views = {s.name: self._view(self.buffer, s) for s in self.regions}
        self.device_buffer, self.device_views = None, {}
        self.last_publish, self.last_load = {}, {}
        self._traffic = dict.fromkeys(TRAFFIC, 0)

    @staticmethod
    def _view(buffer: torch.Tensor, region: Region) -> torch.Tensor:
        return buffer[region.offset:region.offset + region.nbytes].view(region.dtype).view(region.shape)

    @property
    def version(self) -> int:
        return int(self._version.item())

    @property
    def nodes(self) -> int:
        return self.d.world_size // self.d.local_world_size

    def publish(self, named_tensors, version: int) -> None:
        """Collective over all ranks: each node's local rank 0 writes the full tensors it is handed (each
        node reads its own, nothing crosses nodes); a node whose writer is handed nothing keeps what it had.

        `named_tensors` is iterated on every rank (it may gather shards, which is collective)."""
        start, written = time.perf_counter(), 0
        # No rank may still be reading the previous version while it is overwritten.
        dist.barrier(group=self.d.control)
        for name, tensor in named_tensors:
            if self.d.local_rank == 0:
                self.views[name].copy_(tensor)
                written += tensor.numel() * tensor.element_size()
        self._finish(version if written else None)
        self._record(start, written, local=written, across_nodes=0)

    def publish_shards(self, named_rows, version: int) -> None:
        """Collective over all ranks: each rank writes the rows it holds, `(name, rows, first_row)`, or
        nothing (an empty list); no two ranks write the same row. Afterwards every node's replica holds
        every rank's rows, and rows that no rank wrote hold what they held before. The highest version a
        writing rank passes becomes the stored one: a publish in which no rank writes changes nothing.

        Each rank writes its rows straight into its node's shared buffer; on one node that is all (no
        gather, no extra copy). Across nodes each rank then broadcasts its rows to its peers (the ranks of
        its local index on the other nodes, `Dist.peers`) over the tensor backend, and they write them into
        their nodes' buffers: a row crosses to each other node once, from the rank that wrote it."""
        start = time.perf_counter()
        dist.barrier(group=self.d.control)  # no rank may still be reading rows about to change
        mine = [(name, first, self._fits(name, rows, first)) for name, rows, first in named_rows]
        for name, first, rows in mine:
            self.views[name][first:first + rows.shape[0]].copy_(rows)
        wrote = [None] * self.d.world_size  # per rank: (version, bytes), or None if it wrote nothing
        size = sum(self._run(name, first, rows.shape[0])[1] for name, first, rows in mine)
        dist.all_gather_object(wrote, (version, size) if mine else None, group=self.d.control)
        if self.d.peers is not None:
            self._replicate(mine)
        versions = [w[0] for w in wrote if w is not None]
        self._finish(max(versions) if versions else None)
        sizes = [w[1] if w else 0 for w in wrote]
        node = sizes[self.d.node * self.d.local_world_size:(self.d.node + 1) * self.d.local_world_size]
        self._record(start, sum(sizes), local=sum(node), across_nodes=sum(sizes) * (self.nodes - 1))

    def _fits(self, name: str, rows: torch.Tensor, first: int) -> torch.Tensor:
        region = self.region[name]
        if tuple(rows.shape[1:]) != region.shape[1:] or not 0 <= first <= first + rows.shape[0] <= region.shape[0]:
            raise ValueError(f"{name}: rows {first}..{first + rows.shape[0]} of shape {tuple(rows.shape)} do not "
                             f"fit its stored shape {region.shape}")
        return rows

    def _run(self, name: str, first: int, count: int) -> tuple[int, int]:
        """Where rows [first, first + count) of `name` lie in the buffer: (byte offset, bytes)."""
        region = self.region[name]
        row = math.prod(region.shape[1:]) * region.dtype.itemsize
        return region.offset + first * row, count * row

    def _replicate(self, mine) -> None:
        """Every writer's rows into its peers' replicas. The peers learn which rows each writer holds
        (region index, first row, rows), then take each writer's rows in turn, in pieces of at most _PIECE
        bytes, each broadcast from a staging buffer on the device (NCCL takes device tensors)."""
        d = self.d
        claims = [None] * self.nodes
        dist.all_gather_object(claims, [(self.index[name], first, rows.shape[0]) for name, first, rows in mine],
                               group=d.peers)
        for node, claim in enumerate(claims):
            runs = [self._run(self.regions[index].name, first, count) for index, first, count in claim]
            if not sum(n for _, n in runs):
                continue
            writer = node * d.local_world_size + d.local_rank
            staged = torch.empty(min(_PIECE, sum(n for _, n in runs)), dtype=torch.uint8, device=d.device)
            if writer == d.rank:
                sources = [as_bytes(rows, self.region[name].dtype) for name, _, rows in mine]
            else:
                targets = [self.buffer[offset:offset + n] for offset, n in runs]
            for piece in pieces([n for _, n in runs], _PIECE):
                part = staged[:sum(stop - begin for _, begin, stop in piece)]
                if writer == d.rank:
                    pack(piece, sources, part)
                dist.broadcast(part, src=writer, group=d.peers)
                if writer != d.rank:
                    unpack(piece, part, targets)
        if d.device.type == "cuda":
            torch.cuda.synchronize()  # the copies out of the staging buffer ran asynchronously

    def _finish(self, version: int | None) -> None:
        """Ends a publish: the new version (None: nothing was written, the stored one stays) is set once
        every rank's rows are in, and followed by the device copy."""
        if self.d.local_rank == 0 and version is not None:
            self._version.fill_(version)
            if self.device_buffer is not None:
                self.device_buffer.copy_(self.buffer, non_blocking=True)
                torch.cuda.synchronize()
        dist.barrier(group=self.d.control)

    def _record(self, start: float, written: int, local: int, across_nodes: int) -> None:
        """last_publish: bytes into each replica, of them written by this node's own ranks, bytes that
        crossed between nodes (all nodes together), this rank's seconds; added to the traffic tally."""
        self.last_publish = {"version": self.version, "bytes": written, "bytes_local": local,
                             "bytes_across_nodes": across_nodes, "seconds": time.perf_counter() - start}
        self._traffic["publishes"] += 1
        for key in TRAFFIC[1:]:
            self._traffic[key] += self.last_publish[key]

    def traffic(self) -> dict:
        """The publishes since the last call and their `last_publish` figures, summed."""
        taken, self._traffic = self._traffic, dict.fromkeys(TRAFFIC, 0)
        return taken

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Zero-copy views of the published version, in layout order: the device copy's when there is
        one (engines then load device to device), else the host buffer's."""
        views = self.device_views or self.views
        return [(s.name, views[s.name]) for s in self.regions]

    def load_into(self, engine) -> dict:
        """Loads the published version into a vLLM engine (`roles.engine.Engine`); returns bytes and
        seconds. On CPU, vLLM repacks every linear weight for oneDNN as it loads: that, not the copy
        out of storage, is most of the time."""
        start = time.perf_counter()
        engine.load_weights(self.named_tensors())
        self.last_load = {"version": self.version, "bytes": self.nbytes - _HEADER,
                          "seconds": time.perf_counter() - start}
        return self.last_load

    def share_on_device(self) -> None:
        """Collective, CUDA only: one device-resident copy per node on local rank 0's device, which the
        other local ranks map through CUDA IPC; it follows every later publish."""
        handle = None
        if self.d.local_rank == 0:
            self.device_buffer = self.buffer.to(self.d.device)
            handle = export_cuda(self.device_buffer)
        handles = [None] * self.d.world_size
        dist.all_gather_object(handles, handle, group=self.d.control)
        if self.d.local_rank != 0:
            self.device_buffer = import_cuda(handles[self.d.node * self.d.local_world_size])
        self.device_views = {s.name: self._view(self.device_buffer, s) for s in self.regions}
        dist.barrier(group=self.d.control)

    def close(self) -> None:
        """Drops this rank's mapping; the memory is freed when the node's last rank lets go."""
        if self.buffer is not None and torch.cuda.is_available():
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr()))
        self.views, self.buffer, self._version = {}, None, None
        self.device_views, self.device_buffer = {}, None


def export_cuda(tensor: torch.Tensor):
    """A picklable CUDA IPC handle to `tensor`'s memory; the exporter must keep `tensor` alive."""
    from torch.multiprocessing.reductions import reduce_tensor
    return reduce_tensor(tensor)


def import_cuda(handle) -> torch.Tensor:
    """The tensor another process exported, mapped into this one (no copy)."""
    rebuild, args = handle
    return rebuild(*args)


def checkpoint_storage(d: Dist, model: str, model_dir: str, dtype: torch.dtype) -> ParameterStorage:
    """A storage holding a Hugging Face checkpoint's weights as version 0 (a frozen judge, for one).
    Every rank reads the names and shapes; each node's writer reads the tensors."""
    from safetensors import safe_open
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    shapes = []
    for path in files:
        with safe_open(path, "pt") as f:
            shapes += [(name, tuple(f.get_slice(name).get_shape()), dtype) for name in f.keys()]
    storage = ParameterStorage(d, model, shapes)
    storage.publish(_read_checkpoint(files) if d.local_rank == 0 else [], version=0)
    return storage


def _read_checkpoint(files):
    from safetensors import safe_open
    for path in files:
        with safe_open(path, "pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class TrainState:
    """The policy's FSDP training state, full-shaped in storage, so a train group of any size loads
    its own rows: fp32 master weights and AdamW's exp_avg and exp_avg_sq per parameter, and the step.

    Version 0 is the checkpoint with zero moments, which is exactly a fresh AdamW's state. The frozen
    part (model buffers such as rotary frequencies, which a module built on the meta device lacks, and
    the reference policy when a KL term needs one) is a second storage, written once. With
    `keep_grads`, a third holds the gradients a train group has accumulated in a step before its
    optimizer step (early training), so that a train group that changes mid-step carries them over;
    it is never checkpointed (a checkpoint is taken between steps, when there are none)."""

    FIELDS = ("master", "exp_avg", "exp_avg_sq")

    def __init__(self, d: Dist, policy_dir: str, keep_reference: bool, keep_grads: bool = False):
        from transformers import AutoConfig, AutoModelForCausalLM
        self.config = AutoConfig.from_pretrained(policy_dir)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
        self.params = [(name, tuple(p.shape)) for name, p in skeleton.named_parameters()]
        f32 = torch.float32
        self.state = ParameterStorage(d, "policy-train", [(f"{field}/{name}", shape, f32)
                                                         for field in self.FIELDS for name, shape in self.params]
                                      + [("step", (1,), f32)])
        self.frozen = ParameterStorage(d, "policy-frozen",
                                       [(f"buffer/{n}", tuple(b.shape), b.dtype) for n, b in skeleton.named_buffers()]
                                       + [(f"reference/{n}", s, f32) for n, s in self.params if keep_reference])
        # grad_tokens: the response tokens whose gradients the stored rows sum (0: none stored).
        self.partial = ParameterStorage(d, "policy-grads", [(f"grad/{n}", s, f32) for n, s in self.params]
                                        + [("grad_tokens", (1,), f32)]) if keep_grads else None
        initial = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=f32) if d.local_rank == 0 else None
        weights = [] if initial is None else [(n, p.detach()) for n, p in initial.named_parameters()]
        self.state.publish([(f"master/{n}", w) for n, w in weights], version=0)
        self.frozen.publish([(f"buffer/{n}", b) for n, b in ([] if initial is None else initial.named_buffers())]
                            + [(f"reference/{n}", w) for n, w in weights if keep_reference], version=0)

    def view(self, name: str) -> torch.Tensor:
        for storage in (self.state, self.frozen, self.partial):
            if storage is not None and name in storage.views:
                return storage.views[name]
        raise KeyError(name)

    def stored_grad_tokens(self) -> int:
        """Response tokens whose accumulated gradients storage holds (0 without early training)."""
        return int(self.view("grad_tokens")[0].item()) if self.partial is not None else 0

    def weight_shapes(self, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The layout of the policy's published weights, in `dtype`."""
        return [(name, shape, dtype) for name, shape in self.params]

    def save(self, trainer) -> None:
        """Collective over all ranks: each train rank writes its rows (`PolicyTrainer.state_rows`);
        ranks outside the train group pass None and write nothing."""
        self.state.publish_shards([] if trainer is None else trainer.state_rows(),
                                  self.state.version if trainer is None else trainer.optimizer_steps)
        if self.partial is not None:
            self.partial.publish_shards([] if trainer is None else trainer.grad_rows(),
                                        self.partial.version if trainer is None else trainer.optimizer_steps)

    def publish_weights(self, policy: ParameterStorage, version: int) -> None:
        """Collective: publishes the stored master weights, cast to the policy storage's dtype."""
        named = [(n, self.view(f"master/{n}")) for n, _ in self.params] if self.state.d.local_rank == 0 else []
        policy.publish(named, version)

    def close(self) -> None:
        for storage in (self.state, self.frozen, self.partial):
            if storage is not None:
                storage.close()
