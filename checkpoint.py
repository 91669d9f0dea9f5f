"""Checkpoints of a run, in OUT/checkpoints/: the policy's whole training state (the bytes of the
TrainState storage: fp32 master weights, AdamW moments, optimizer step), the number of steps done, and
the policy as a Hugging Face directory (model/, export.py) for loading it elsewhere.

A checkpoint is written to a temporary folder, flushed, then renamed, and only then named in LATEST
(written the same way), so LATEST always names a complete checkpoint and one cut short is never
resumed from. With it goes what the pivot planner has learned (engine-step fits, shift costs, lengths
seen, the training speed) and, with --max-staleness K > 0, the K steps generated and judged ahead of the update
(pending.json), and where the data stream stands (the prompts drawn so far). Nothing else needs saving for
an exact resume: every sample's seed and a forced shift schedule are functions of (seed, step), the data
order of the seed, and the metrics so far are in OUT already.
"""
import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist

import algorithm
import export
import faults
from roles.rollout import Sample

# Bytes per read or write: the state moves between disk and storage with no full copy of it in between.
_CHUNK = 64 << 20

# The flags a resumed run must share with the run it continues (--steps may grow): every flag of the
# algorithm (algorithm.FLAGS) and these.
SAME_FLAGS = ("policy", "judge_model", "judge_template", "judge_kind", "data", "eval_data", "eval_split", "seed",
              "prompts_per_step", "group_size", "temperature", "max_response_tokens", "max_critique_tokens",
              "lr", "weight_decay", "grad_clip", "minibatches", "placement", "split", "force_shifts", "adam_betas",
              "workload", "max_staleness", "updates", "lr_warmup_steps", "answer_marker", "filter_groups",
              "filter_groups_max_prompts", *algorithm.FLAGS)


def latest(out: Path) -> dict | None:
    marker = out / "checkpoints" / "LATEST"
    if not marker.exists():
        return None
    folder = out / "checkpoints" / marker.read_text().strip()
    return {"folder": folder, **json.loads((folder / "meta.json").read_text())}


def differing_flags(saved: dict, args, defaults: dict) -> list[str]:
    """The flags of SAME_FLAGS whose value in the run's saved config.json (`saved`) differs from this
    launch's, each as --flag old -> new. A flag the saved config lacks (the run began before it existed)
    counts as its default: so a run checkpointed before a flag was added resumes after it, at its default."""
    return [f"--{k.replace('_', '-')} {saved.get(k, defaults[k])!r} -> {getattr(args, k)!r}"
            for k in SAME_FLAGS if saved.get(k, defaults[k]) != getattr(args, k)]


def save(d, out: Path, steps_done: int, train_state, context, policy_dir: str, planner: dict | None = None,
         pending: list[list] | None = None, data_position: int = 0) -> None:
    """Collective. Train ranks still holding their trainer first write its rows to storage; node 0's
    ranks write the policy's Hugging Face directory from it (`export.write_model`, under the checkpoint
    of `policy_dir`); then rank 0 writes its node's copy of the state, what the planner has learned
    (`planner`, rank 0's), the prompts the steps rolled out have drawn from the data stream
    (`data_position`) and, with --max-staleness, the samples of the steps generated and judged whose
    updates are still to come (`pending`, oldest first)."""
    train_state.save(context.trainer)
    root = out / "checkpoints"
    name = f"step-{steps_done:06d}"
    tmp = root / f".{name}.tmp"
    export.write_model(d, train_state, policy_dir, tmp / "model")
    if d.rank == 0:
        _write(tmp / "state.bin", memoryview(train_state.state.buffer.numpy()))
        meta = {"steps_done": steps_done, "planner": planner, "data_position": data_position}
        _write(tmp / "meta.json", json.dumps(meta).encode())
        if pending:
            steps = [[dataclasses.asdict(s) for s in step] for step in pending]
            _write(tmp / "pending.json", json.dumps(steps).encode())
        faults.point("checkpoint", d.rank)
        if (root / name).exists():  # renamed by a run killed before naming it in LATEST: never resumed from
            shutil.rmtree(root / name)
        os.replace(tmp, root / name)
        _write(root / ".LATEST.tmp", name.encode())
        os.replace(root / ".LATEST.tmp", root / "LATEST")
    dist.barrier(group=d.control)


def pending_steps(checkpoint: dict) -> list[list[Sample]]:
    """The samples of the steps generated before the checkpoint whose updates come after it."""
    path = checkpoint["folder"] / "pending.json"
    return [[Sample(**s) for s in step] for step in json.loads(path.read_text())] if path.exists() else []


def every_node_sees(d, out: Path, checkpoint: dict | None) -> None:
    """Collective: every rank must have found the same checkpoint to resume from. Rank 0 writes them and
    each node's writer reads them back (`restore`), so --out must be one filesystem that all nodes share."""
    seen = [None] * d.world_size
    dist.all_gather_object(seen, checkpoint and checkpoint["folder"].name, group=d.control)
    if len(set(seen)) > 1:
        found = ", ".join(f"rank {rank}: {name or 'none'}" for rank, name in enumerate(seen))
        raise SystemExit(f"--out {out}: the ranks see different checkpoints ({found}); checkpoints are written by "
                         f"rank 0 and read on every node, so --out must be on a filesystem every node shares")


def restore(d, checkpoint: dict, train_state) -> None:
    """Collective: each node's writer reads the checkpoint straight into its copy of the training state."""
    if d.local_rank == 0:
        path = checkpoint["folder"] / "state.bin"
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size != train_state.state.nbytes:
                raise SystemExit(f"{checkpoint['folder']}: the saved training state has {size} bytes, this policy's "
                                 f"has {train_state.state.nbytes}: is --policy the checkpoint's model?")
            into = memoryview(train_state.state.buffer.numpy())
            at = 0
            while at < len(into):
                read = f.readinto(into[at:at + _CHUNK])
                if not read:
                    raise SystemExit(f"{path}: ended after {at} of {size} bytes while being read")
                at += read
    dist.barrier(group=d.control)


def _write(path: Path, data) -> None:
    """Writes `data` (bytes-like) in chunks from its own memory, then flushes it to disk."""
    data = memoryview(data)
    with open(path, "wb", buffering=0) as f:
        at = 0
        while at < len(data):
            at += f.write(data[at:at + _CHUNK])  # an unbuffered write may take less than it is given
        os.fsync(f.fileno())
