"""`pivot_train.py --dry-run --world-size N`: checks a configuration for N ranks and prints each rank's
initial role and what each role holds per device, before anything runs at that scale. No process group,
no device and no weights: the models are built on the meta device (as accelerate's init_empty_weights
does), from their config.json alone, to count their parameters and shapes.

The placement is the one given: colocated and pivot start every rank in rollout (pivot's planner then
moves them) and train on every rank at the step's end; disaggregated keeps its --split (of slots of
--engine-tp ranks), and only the split's train ranks shard the training state. Per device, the figures are
those of the GPU path (bf16 engines and activations, fp32 master weights, grads and AdamW moments): a
rollout or judge rank holds its share of its model's weights (all of them, or at --engine-tp T what vLLM
gives one of the engine's T ranks: `roles.engine.params_per_rank`) and its engine's KV cache
(`--kv-cache-mb`, per rank); a train rank holds its FSDP2 rows (Shard(0), as `storage.shard_rows` splits
them) of the master weights, grads and both moments, the root unit and two decoder layers gathered, and
the largest of what one micro-batch adds on the way (`train_memory`). The judge's engine stays on the
device for the whole run (docs/gpu.md), so a rank peaks at it plus the larger of the policy's engine and
the trainer.
Per node, the Global Parameter Storage keeps one host copy of each model's weights and the policy's
full training state.
"""
import math
import sys

import torch

import algorithm
from roles import Role
from shifting import book
from roles.trainer import decoder_layers, inference_dtype, logit_chunk_positions
from storage import shard_rows

GIB = 1 << 30
MIB = 1 << 20


def model_summary(model_dir: str, dtype: torch.dtype, engine_tp: int = 1) -> dict:
    """Parameter shapes, weight bytes and KV bytes per token of `model_dir`, from its config alone, and what one
    rank of an engine of `engine_tp` ranks holds of its weights and of each token's KV cache."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(model_dir)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as e:
        sys.exit(f"{model_dir}: transformers cannot build this model ({e}); pick a model whose architecture "
                 f"transformers supports")
    from roles.engine import params_per_rank, unsupported_architectures
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
    params = sum(math.prod(s) for s in shapes)
    layer_params = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    rank_kv_heads = engine_heads(model_dir, heads, kv_heads, engine_tp)
    return {"dir": model_dir, "architecture": ",".join(config.architectures or [type(model).__name__]),
            "shapes": shapes, "params": params, "layer_params": max(layer_params),
            "root_params": params - sum(layer_params), "largest_param": max(math.prod(s) for s in shapes),
            "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
            "kv_bytes_per_token": 2 * text.num_hidden_layers * kv_heads * head_dim * dtype.itemsize,
            "engine_tp": engine_tp, "engine_params_per_rank": params_per_rank(model, engine_tp),
            "engine_kv_bytes_per_token": 2 * text.num_hidden_layers * rank_kv_heads * head_dim * dtype.itemsize,
            "layers": text.num_hidden_layers, "hidden": text.hidden_size, "vocab": text.vocab_size,
            "q_width": heads * head_dim, "kv_width": kv_heads * head_dim, "heads": heads,
            "intermediate": text.intermediate_size, "qk_norm": hasattr(layers[0].self_attn, "q_norm"),
            "experts": getattr(text, "num_experts", None) or 0,
            "experts_per_token": getattr(text, "num_experts_per_tok", None) or 0,
            "expert_intermediate": getattr(text, "moe_intermediate_size", None) or 0}


def engine_heads(model_dir: str, heads: int, kv_heads: int, engine_tp: int) -> int:
    """The KV heads one rank of an engine of `engine_tp` ranks holds, after vLLM's own checks
    (ModelConfig.verify_with_parallel_config, QKVParallelLinear in vllm/model_executor/layers/linear.py): the
    attention heads split evenly, and the KV heads too, or each is copied onto `engine_tp / kv_heads` ranks."""
    if heads % engine_tp:
        sys.exit(f"{model_dir}: its {heads} attention heads do not split over --engine-tp {engine_tp}: pass an "
                 f"--engine-tp that divides {heads}")
    if kv_heads % engine_tp and engine_tp % kv_heads:
        sys.exit(f"{model_dir}: its {kv_heads} KV heads neither split over nor divide --engine-tp {engine_tp}: pass "
                 f"an --engine-tp that {kv_heads} divides or that divides {kv_heads}")
    from roles.engine import kv_heads_per_rank
    return kv_heads_per_rank(kv_heads, engine_tp)


def fsdp_rows(shapes: list[tuple], ranks: int) -> int:
    """Elements held by the rank with the most (rank 0: FSDP2 gives the first ranks the full chunks)."""
    total = 0
    for shape in shapes:
        start, stop = shard_rows(shape[0], 0, ranks)
        total += (stop - start) * math.prod(shape[1:])
    return total


def layer_activation_bytes(m: dict, dtype: torch.dtype) -> int:
    """Bytes per token a decoder layer keeps for backward (transformers' Qwen2/Llama/Qwen3 layers under
    SDPA): counted from what each op saves, in `dtype` (an RMSNorm also keeps an fp32 copy of its input)."""
    s = dtype.itemsize

    def norm(width):  # fp32 input (the input itself in fp32), its normalised fp32 and dtype forms
        return width * (4 + 2 * s)
    q, kv = m["q_width"], m["kv_width"]
    # rotated q and k, v, the attention output and its contiguous copy; logsumexp per head
    attention = (3 * q + 2 * kv) * s + 4 * m["heads"]
    if kv < q:
        attention += 2 * q * s  # k and v repeated to every head
    if m["qk_norm"]:
        attention += (q + kv) * (4 + s)  # q_norm and k_norm: an fp32 copy and the normalised q and k
    if m["experts"]:
        # each token's copy to its experts, their gate, up, activation, product and output; router logits
        mlp = m["experts_per_token"] * (2 * m["hidden"] + 4 * m["expert_intermediate"]) * s + 8 * m["experts"]
    else:
        mlp = 4 * m["intermediate"] * s  # gate, up, activation, their product
    return 2 * norm(m["hidden"]) + attention + mlp


def micro_batch_shape(args) -> tuple[int, int, int]:
    """(tokens, response positions, padded length) of the largest micro-batch the flags allow."""
    longest, budget = args.max_model_len, args.micro_batch_tokens
    tokens = args.micro_batch * longest
    if budget:
        tokens = min(tokens, max(budget, longest))  # a longer sample goes alone
    positions = min(tokens, args.micro_batch * args.max_response_tokens)
    if budget and budget < longest:  # short samples within the budget, or one long sample alone
        positions = max(min(budget, positions), min(args.max_response_tokens, longest))
    return tokens, positions, longest


def train_memory(m: dict, ranks: int, shape: tuple[int, int, int], *, activation_checkpointing: bool,
                 kl: bool, device: str = "cuda") -> tuple[dict, str]:
    """Bytes a train rank holds at the peak of a step, by part, and the moment it peaks. The trainer's
    dtypes on `device`: bf16 gathered weights and activations on "cuda", fp32 on "cpu" (what the
    bench measures); AdamW's foreach (CUDA) or per-tensor (CPU) temporaries.

    The candidates: entering backward (every saved activation, one chunk of logits recomputed and in
    its backward); with activation checkpointing, inside a layer's backward (its activations again
    and their gradients); the end of backward (the root unit's gradients); the optimizer step. The
    sharded gradients count throughout, as they do from the second micro-batch of a minibatch on; the
    lm_head's unsharded gradient from the first chunk of logits until the root unit's reduce-scatter."""
    tokens, positions, longest = shape
    dtype = inference_dtype(torch.device(device))
    s = dtype.itemsize
    rows = fsdp_rows(m["shapes"], ranks)
    state = {"master_fp32": rows * 4, "grads_fp32": rows * 4, "adamw_moments_fp32": 2 * rows * 4}
    if kl:
        state["reference_fp32"] = rows * 4
    state["gathered_params"] = (m["root_params"] + 2 * m["layer_params"]) * s
    layer = tokens * layer_activation_bytes(m, dtype)
    # the final norm's, the response positions' hidden states, the attention mask
    around = tokens * m["hidden"] * (4 + 2 * s) + positions * m["hidden"] * s + tokens * longest * s
    saved = m["layers"] * (tokens * m["hidden"] * s if activation_checkpointing else layer) + around
    head_grad = m["root_params"] * s
    # a chunk's log-softmax output, the gradient into it and out of it, fp32; the dtype logits too
    chunk = min(positions, logit_chunk_positions(m["vocab"])) * m["vocab"] * (12 + (s if s < 4 else 0))
    phases = {"entering backward": {"activations": saved, "logits": chunk, "head_gradient": head_grad}}
    if activation_checkpointing:
        # the layer's gradients into its MLP and residual stream as backward walks through it
        backward = tokens * (3 * (m["expert_intermediate"] * m["experts_per_token"] or m["intermediate"])
                             + 2 * m["hidden"]) * s
        phases["a layer's backward"] = {"activations": saved + layer + backward, "head_gradient": head_grad}
    # the embedding's gradient, the lm_head's (the same weight when tied) and their sum, before the reduce-scatter
    phases["the end of backward"] = {"embedding_and_head_gradients": 3 * head_grad}
    phases["the optimizer step"] = {"optimizer_temporaries": (rows if device == "cuda" else 2 * m["largest_param"]) * 4}
    peak = max(phases, key=lambda k: sum(phases[k].values()))
    return {**state, **phases[peak]}, peak


def sizing(args, placement_options) -> dict:
    """The checked sizing of a run on `args.world_size` ranks under `placement_options`
    (shifting/placement.py's, as pivot_train.py checks them): roles, per-device bytes per role, per-node
    bytes."""
    world, engine_tp = args.world_size, args.engine_tp
    if world < 1:
        sys.exit("--world-size must be at least 1")
    per_node = min(args.nproc_per_node, world)
    if world % per_node:
        sys.exit(f"--world-size {world} is not a whole number of nodes of --nproc-per-node {per_node}: "
                 f"pass --world-size {world + per_node - world % per_node} or a --nproc-per-node that divides {world}")
    if per_node % engine_tp:
        sys.exit(f"--engine-tp {engine_tp} does not divide the {per_node} ranks of a node: an engine spans ranks of "
                 f"one node; pass an --engine-tp that divides --nproc-per-node")
    dtype, f32 = inference_dtype(torch.device("cuda")), torch.float32.itemsize
    policy, judge = model_summary(args.policy, dtype, engine_tp), model_summary(args.judge_model, dtype, engine_tp)
    kv = {"policy": args.kv_cache_mb * MIB, Role.JUDGE: (args.judge_kv_cache_mb or args.kv_cache_mb) * MIB}
    for name, m in (("policy", policy), (Role.JUDGE, judge)):
        tokens = kv[name] // m["engine_kv_bytes_per_token"]
        if tokens < args.max_model_len:
            need = -(-args.max_model_len * m["engine_kv_bytes_per_token"] // MIB)
            flag = "--kv-cache-mb" if name == "policy" else "--judge-kv-cache-mb"
            sys.exit(f"{flag} {kv[name] // MIB} holds {tokens} tokens of the {name}'s KV cache per rank, fewer than "
                     f"one sequence of --max-model-len {args.max_model_len}: raise {flag} to at least {need}")
    from shifting.placement import Placement
    placement = Placement(placement_options, world // engine_tp)
    roles = book.rank_roles(placement.start_roles(), engine_tp)
    train_ranks = placement.most_train_ranks() * engine_tp
    reference = algorithm.from_args(args).keeps_reference
    train, train_peak = train_memory(policy, train_ranks, micro_batch_shape(args),
                                     activation_checkpointing=args.activation_checkpointing, kl=reference)
    device = {Role.ROLLOUT: {"weights": policy["engine_params_per_rank"] * dtype.itemsize, "kv_cache": kv["policy"]},
              Role.JUDGE: {"weights": judge["engine_params_per_rank"] * dtype.itemsize, "kv_cache": kv[Role.JUDGE]},
              Role.TRAIN: train}
    node = {"policy_weights": policy["params"] * dtype.itemsize, "judge_weights": judge["params"] * dtype.itemsize,
            "policy_train_state_fp32": 3 * policy["params"] * f32 + policy["buffer_bytes"]}
    if reference:
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
    # On GPU the judge's engine keeps its weights and KV cache on the device for the whole run, beside the
    # policy's engine (asleep while the rank does anything else) or the trainer (docs/gpu.md, "Memory per device").
    peak_role = max((Role.ROLLOUT, Role.TRAIN), key=need.get)
    peak = need[Role.JUDGE] + need[peak_role]
    if args.device_memory_gib and peak > args.device_memory_gib * GIB:
        change = ("raise --world-size or the split's train ranks, lower --micro-batch or --micro-batch-tokens, or "
                  "pass --activation-checkpointing" if peak_role == Role.TRAIN else
                  f"raise --engine-tp (now {engine_tp}) to spread each engine over more of a node's ranks, lower "
                  f"--kv-cache-mb, or use a smaller model")
        judge = _size(need[Role.JUDGE])
        sys.exit(f"a {peak_role} rank would need {_size(peak)} with the judge's engine beside it ({judge}), "
                 f"over --device-memory-gib {args.device_memory_gib}: {change}; or lower --judge-kv-cache-mb")
    return {"world_size": world, "nodes": world // per_node, "ranks_per_node": per_node, "dtype": str(dtype),
            "engine_tp": engine_tp, "engines": world // engine_tp,
            "placement": args.placement, "roles": roles, "train_ranks": train_ranks, "train_peak": train_peak,
            "micro_batch": dict(zip(("tokens", "response_positions", "longest"), micro_batch_shape(args))),
            "activation_checkpointing": args.activation_checkpointing, "policy": _public(policy),
            Role.JUDGE: _public(judge), "device_bytes": device, "device_peak_bytes": peak, "peak_role": peak_role,
            "node_host_bytes": node,
            "notes": notes}


THEN = {"colocated": "every rank then judges and trains in turn",
        "pivot": "the planner moves ranks between roles as the step runs; every rank trains at its end",
        "disaggregated": "each rank keeps its role"}


def print_sizing(p: dict) -> None:
    print(f"dry run: {p['world_size']} ranks = {p['nodes']} nodes x {p['ranks_per_node']}; placement {p['placement']}; "
          f"engines, gathered weights and activations in {p['dtype'].removeprefix('torch.')}")
    for name in ("policy", Role.JUDGE):
        m = p[name]
        count = f"{m['params'] / 1e9:.2f}B" if m["params"] >= 1e9 else f"{m['params'] / 1e6:.2f}M"
        print(f"  {name}: {m['architecture']}, {count} parameters, "
              f"KV cache {m['kv_bytes_per_token']} bytes/token ({m['dir']})")
    if p["engine_tp"] > 1:
        tp, kv = p["engine_tp"], {name: p[name]["engine_kv_bytes_per_token"] for name in ("policy", Role.JUDGE)}
        print(f"engines: {p['engines']} slots of {tp} ranks (--engine-tp), each rank holding 1/{tp} of an engine "
              f"(KV cache per token and rank: policy {kv['policy']} bytes, judge {kv[Role.JUDGE]}); a slot's ranks "
              f"change role together")
    print(f"initial assignment ({THEN[p['placement']]}):")
    for role in sorted(set(p["roles"])):
        ranks = [r for r, held in enumerate(p["roles"]) if held == role]
        print(f"  {role}: ranks {_ranges(ranks)} ({len(ranks)})")
    mb = p["micro_batch"]
    print(f"training: FSDP2 over {p['train_ranks']} ranks; a micro-batch of up to {mb['tokens']} tokens "
          f"({mb['response_positions']} response positions, padded to {mb['longest']}), activation checkpointing "
          f"{'on' if p['activation_checkpointing'] else 'off'}")
    print("memory per device, by role:")
    for role, parts in p["device_bytes"].items():
        detail = ", ".join(f"{k} {_size(v)}" for k, v in parts.items())
        when = f"; at its peak, {p['train_peak']}" if role == Role.TRAIN else ""
        print(f"  {role:8s} {_size(sum(parts.values())):>10s}  ({detail}{when})")
    print(f"  peak     {_size(p['device_peak_bytes']):>10s}  (the judge's engine, on the device throughout, and "
          f"{p['peak_role']}: the larger of the roles beside it)")
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
    ranges, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur != prev + 1:
            ranges.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = cur
    return ", ".join(ranges)
