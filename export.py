"""The policy as a Hugging Face directory (OUT/model, and model/ in every checkpoint): what anyone can load
with `AutoModelForCausalLM.from_pretrained`, serve with vLLM, or pass as --policy to start the next run.

The weights are the stored fp32 master weights (storage.TrainState), under the names and in the dtype of
the policy's own checkpoint: transformers 5 holds a MoE layer's experts fused in one [experts, ...]
tensor, and its own reverse conversion (`revert_weight_conversion`, the one save_pretrained applies)
splits them back into the checkpoint's per-expert tensors. The safetensors files are written by hand
(an 8-byte header length, a JSON header, the raw bytes: the format's specification in
huggingface/safetensors' README), so each tensor goes from the node's shared-memory copy to disk a chunk
at a time, cast chunk by chunk where the checkpoint's dtype is not fp32; no rank holds a copy of the
model. Above MAX_SHARD_BYTES the weights are cut into shards with a model.safetensors.index.json, as
save_pretrained cuts them; node 0's ranks write the shards between them. Beside them go the policy
directory's other files (config.json, tokenizer files, chat template, generation_config.json).
"""
import json
import os
import shutil
import struct
from pathlib import Path

import torch
import torch.distributed as dist

# transformers 4's default max_shard_size (5 GB), the size the Hugging Face Hub advises for a file.
MAX_SHARD_BYTES = 5 * 10**9
# Elements cast and written at a time: a chunk in a dtype other than fp32 is the one copy an export makes.
_CHUNK = 16 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")
# safetensors' dtype names (huggingface/safetensors, safetensors/src/tensor.rs `Dtype`)
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


def skeleton(config):
    """The policy's module on the meta device: its parameter names and shapes, no memory."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def checkpoint_layout(model) -> list[tuple[str, str, tuple[int, ...]]]:
    """(checkpoint name, the module parameter it comes from, shape) of every tensor a checkpoint of
    `model` holds, in parameter order: transformers' reverse conversion, one parameter at a time."""
    from transformers.core_model_loading import revert_weight_conversion
    layout = []
    for name, p in model.named_parameters():
        layout += [(target, name, tuple(t.shape)) for target, t in revert_weight_conversion(model, {name: p}).items()]
    return layout


def checkpoint_dtypes(policy_dir: str) -> dict[str, torch.dtype]:
    """The dtype of each tensor in the policy directory's safetensors files, read from their headers."""
    dtypes = {}
    for path in Path(policy_dir).glob("*.safetensors"):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        dtypes.update({name: DTYPES[entry["dtype"]] for name, entry in header.items() if name != "__metadata__"})
    return dtypes


def shards_of(tensors: list[tuple[str, str, tuple[int, ...], torch.dtype]], limit: int) -> list[list]:
    """`tensors` in order, cut into shards of at most `limit` bytes (a larger tensor is a shard alone)."""
    shards, size = [], 0
    for tensor in tensors:
        nbytes = nbytes_of(tensor[2], tensor[3])
        if not shards or size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += nbytes
    return shards


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def shard_names(count: int) -> list[str]:
    """save_pretrained's file names: model.safetensors alone, else model-0000k-of-0000n.safetensors."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]


def safetensors_header(shard) -> bytes:
    """The shard's header: its length (little-endian u64), then the JSON, padded with spaces to 8 bytes."""
    entries, at = {"__metadata__": {"format": "pt"}}, 0
    for name, _, shape, dtype in shard:
        size = nbytes_of(shape, dtype)
        entries[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [at, at + size]}
        at += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_shard(path: Path, shard, model, master) -> None:
    """One safetensors file: each tensor from `master(parameter name)` (the stored fp32 rows), converted
    to the checkpoint's names by the parameter's reverse conversion, written a chunk at a time."""
    from transformers.core_model_loading import revert_weight_conversion
    with open(path, "wb", buffering=0) as f:
        f.write(safetensors_header(shard))
        for source in dict.fromkeys(parameter for _, parameter, _, _ in shard):
            converted = revert_weight_conversion(model, {source: master(source)})
            for name, parameter, _, dtype in shard:
                if parameter != source:
                    continue
                flat = converted[name].reshape(-1)  # a view of storage unless the conversion copied
                for at in range(0, flat.numel(), _CHUNK):
                    piece = flat[at:at + _CHUNK].to(dtype).contiguous()
                    data = memoryview(piece.view(torch.uint8).numpy())
                    done = 0
                    while done < len(data):
                        done += f.write(data[done:])  # an unbuffered write may take less than it is given
        os.fsync(f.fileno())


def write_model(d, train_state, policy_dir: str, folder: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Collective: the stored master weights as a Hugging Face directory at `folder`, written into a
    temporary folder beside it and renamed once complete. Node 0's ranks write the shards in turn
    (shard k by local rank k mod ranks per node), each from its own mapping of the node's copy; rank 0
    writes the index and copies the policy directory's other files."""
    model = skeleton(train_state.config)
    dtypes = checkpoint_dtypes(policy_dir)
    fallback = getattr(train_state.config, "dtype", None) or torch.float32
    if isinstance(fallback, str):
        fallback = getattr(torch, fallback)
    tensors = [(name, parameter, shape, dtypes.get(name, fallback))
               for name, parameter, shape in checkpoint_layout(model)]
    shards = shards_of(tensors, max_shard_bytes)
    files = shard_names(len(shards))
    tmp = folder.parent / f".{folder.name}.tmp"
    if d.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier(group=d.control)
    if d.node == 0:
        for k in range(d.local_rank, len(shards), d.local_world_size):
            write_shard(tmp / files[k], shards[k], model, lambda n: train_state.view(f"master/{n}"))
    if d.rank == 0:
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(nbytes_of(s, t) for _, _, s, t in tensors)},
                     "weight_map": {name: files[k] for k, shard in enumerate(shards) for name, *_ in shard}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        for path in Path(policy_dir).iterdir():
            if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES):
                shutil.copy2(path, tmp / path.name)
    dist.barrier(group=d.control)
    if d.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    dist.barrier(group=d.control)
