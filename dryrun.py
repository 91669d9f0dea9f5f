"""`pivot_train.py --dry-run --world-size N`: checks a configuration for N ranks and prints each rank's
initial role and what each role holds per device, before anything runs at that scale. No process group,
no device and no weights: the models are built on the meta device (as accelerate's init_empty_weights
does), from their config.json alone, to count their parameters and shapes.

Per device, the figures are those of the GPU path (bf16 engines, fp32 master weights, grads and AdamW
moments): a rollout or genrm rank holds its model's weights and its engine's KV cache (`--kv-cache-mb`);
a train rank holds its FSDP2 rows (Shard(0), as `storage.shard_rows` splits them) of the master weights,
grads and both moments, and one layer gathered at a time. Activations depend on micro-batch and sequence
length and are not estimated. A colocated rank holds one role at a time (the others sleep), so its peak
is its largest role. Per node, the Global Parameter Storage keeps one host copy of each model's weights
and the policy's full training state.
"""
import math
import sys

import torch

from roles.trainer import decoder_layers, inference_dtype
from storage import shard_rows

GIB = 1 << 30
MIB = 1 << 20


def model_summary(model_dir: str, dtype: torch.dtype) -> dict:
    """Parameter shapes, weight bytes and KV bytes per token of `model_dir`, from its config alone."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(model_dir)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as e:
        sys.exit(f"{model_dir}: transformers cannot build this model ({e}); pick a model whose architecture "
                 f"transformers supports")
    from roles.engine import unsupported_architectures
    missing = unsupported_architectures(config.architectures or [])
    if missing:
        sys.exit(f"{model_dir}: vLLM cannot run {', '.join(missing)}; pick a model whose architecture vLLM supports")
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    shapes = [tuple(p.shape) for p in model.parameters()]  # tied weights once
    try:
        layers = decoder_layers(model)
    except ValueError as e:
        sys.exit(f"{model_dir}: {e}")
    return {"dir": model_dir, "architecture": ",".join(config.architectures or [type(model).__name__]),
            "shapes": shapes, "params": sum(math.prod(s) for s in shapes),
            "layer_params": max(sum(p.numel() for p in layer.parameters()) for layer in layers),
            "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
            "kv_bytes_per_token": 2 * text.num_hidden_layers * kv_heads * head_dim * dtype.itemsize}


def fsdp_rows(shapes: list[tuple], ranks: int) -> int:
    """Elements held by the rank with the most (rank 0: FSDP2 gives the first ranks the full chunks)."""
    total = 0
    for shape in shapes:
        start, stop = shard_rows(shape[0], 0, ranks)
        total += (stop - start) * math.prod(shape[1:])
    return total


def plan(args) -> dict:
    """The checked plan for `args.world_size` ranks: roles, per-device bytes per role, per-node bytes."""
    world = args.world_size
    if world < 1:
        sys.exit("--world-size must be at least 1")
    per_node = min(args.nproc_per_node, world)
    if world % per_node:
        sys.exit(f"--world-size {world} is not a whole number of nodes of --nproc-per-node {per_node}: "
                 f"pass --world-size {world + per_node - world % per_node} or a --nproc-per-node that divides {world}")
    dtype, f32 = inference_dtype(torch.device("cuda")), torch.float32.itemsize
    policy, genrm = model_summary(args.policy, dtype), model_summary(args.genrm, dtype)
    kv = args.kv_cache_mb * MIB
    for name, m in (("policy", policy), ("genrm", genrm)):
        tokens = kv // m["kv_bytes_per_token"]
        if tokens < args.max_model_len:
            need = -(-args.max_model_len * m["kv_bytes_per_token"] // MIB)
            sys.exit(f"--kv-cache-mb {args.kv_cache_mb} holds {tokens} tokens of the {name}'s KV cache, fewer than "
                     f"one sequence of --max-model-len {args.max_model_len}: raise --kv-cache-mb to at least {need}")
    roles = ["rollout"] * world  # colocated: every rank starts in rollout, then judges, then trains
    train_ranks = world
    rows = fsdp_rows(policy["shapes"], train_ranks)
    train = {"master_fp32": rows * f32, "grads_fp32": rows * f32, "adamw_moments_fp32": 2 * rows * f32,
             "gathered_layer": policy["layer_params"] * dtype.itemsize}
    if args.kl_coef > 0:
        train["reference_fp32"] = rows * f32
    device = {"rollout": {"weights": policy["params"] * dtype.itemsize, "kv_cache": kv},
              "genrm": {"weights": genrm["params"] * dtype.itemsize, "kv_cache": kv},
              "train": train}
    node = {"policy_weights": policy["params"] * dtype.itemsize, "genrm_weights": genrm["params"] * dtype.itemsize,
            "policy_train_state_fp32": 3 * policy["params"] * f32 + policy["buffer_bytes"]}
    if args.kl_coef > 0:
        node["reference_fp32"] = policy["params"] * f32
    samples = args.prompts_per_step * args.group_size
    notes = []
    if samples < world:
        notes.append(f"only {samples} samples per step (--prompts-per-step x --group-size) for {world} ranks: "
                     f"{world - samples} ranks have no rollout or judge work")
    if samples // args.minibatches < train_ranks:
        notes.append(f"a minibatch of {samples // args.minibatches} samples over {train_ranks} train ranks: "
                     f"some ranks train on nothing (raise --prompts-per-step or lower --minibatches)")
    need = {role: sum(parts.values()) for role, parts in device.items()}
    peak_role = max(need, key=need.get)
    peak = need[peak_role]
    if args.device_memory_gib and peak > args.device_memory_gib * GIB:
        change = ("raise --world-size: the train shards shrink with it" if peak_role == "train" else
                  "lower --kv-cache-mb, or use a smaller model: each engine holds its whole model "
                  "(tensor_parallel_size=1)")
        sys.exit(f"a {peak_role} rank would need {_size(peak)}, over --device-memory-gib {args.device_memory_gib}: "
                 f"{change}")
    return {"world_size": world, "nodes": world // per_node, "ranks_per_node": per_node, "dtype": str(dtype),
            "roles": roles, "policy": _public(policy), "genrm": _public(genrm), "device_bytes": device,
            "device_peak_bytes": peak, "node_host_bytes": node, "notes": notes}


def print_plan(p: dict) -> None:
    print(f"dry run: {p['world_size']} ranks = {p['nodes']} nodes x {p['ranks_per_node']}; placement colocated; "
          f"engines and gathered layers in {p['dtype'].removeprefix('torch.')}")
    for name in ("policy", "genrm"):
        m = p[name]
        count = f"{m['params'] / 1e9:.2f}B" if m["params"] >= 1e9 else f"{m['params'] / 1e6:.2f}M"
        print(f"  {name}: {m['architecture']}, {count} parameters, "
              f"KV cache {m['kv_bytes_per_token']} bytes/token ({m['dir']})")
    print("initial assignment:")
    for role in sorted(set(p["roles"])):
        ranks = [r for r, held in enumerate(p["roles"]) if held == role]
        print(f"  {role}: ranks {_ranges(ranks)} ({len(ranks)}); colocated ranks then judge and train in turn")
    print("memory per device, by role:")
    for role, parts in p["device_bytes"].items():
        detail = ", ".join(f"{k} {_size(v)}" for k, v in parts.items())
        print(f"  {role:8s} {_size(sum(parts.values())):>10s}  ({detail})")
    print(f"  peak     {_size(p['device_peak_bytes']):>10s}  (one role at a time; activations not included)")
    node = p["node_host_bytes"]
    print(f"host shared memory per node: {_size(sum(node.values()))} ("
          + ", ".join(f"{k} {_size(v)}" for k, v in node.items()) + ")")
    for note in p["notes"]:
        print(f"note: {note}")


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.2f} MiB"


def _public(m: dict) -> dict:
    return {k: v for k, v in m.items() if k != "shapes"}


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur != prev + 1:
            spans.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = cur
    return ", ".join(spans)
