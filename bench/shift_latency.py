"""Shift latency on CPU: every ordered pair of roles (rollout, judge, train), timed stage by stage, for
the built-in models and for a ~100M-parameter Qwen2 made from a config, each set against this
machine's memcpy rate for the same bytes, measured in the same run and thread setting.

    python bench/shift_latency.py [--policy DIR --judge-model DIR] [--repeats 3] [--json PATH]

One process (a world of one): a shift's cost is per rank. Onload rates:
  onload_ratio         storage -> the train role (fp32 master rows and AdamW moments copied into the
                       rank's trainer, kept allocated on CPU), bytes per second over memcpy's; the
                       first arrival builds the trainer instead (FSDP2 on meta, then the same copy):
                       first_train_onload_s
  engine_onload_ratio  storage -> a vLLM engine (reload_weights), over memcpy's; on CPU vLLM repacks
                       every linear weight for oneDNN as it loads, which is most of this time
  engine_pack_ratio    that packing alone, for the same weights, over memcpy's: the floor under the
                       engine onload (vLLM-CPU keeps no unpacked weight to copy into)
"""
import os

# Before torch allocates anything: large host tensors on 2 MiB transparent huge pages. An onload fills
# freshly allocated memory, and on 4 KiB pages the page faults, not the copy, set its speed (here
# about 1 GB/s against memcpy's ~16).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import result_files  # noqa: E402
from roles import Role  # noqa: E402
from roles.engine import Engine  # noqa: E402
from roles.trainer import PolicyTrainer  # noqa: E402
from runtime import init_distributed  # noqa: E402
from shifting.context import STAGES, RoleContext  # noqa: E402
from storage import ParameterStorage, TrainState, checkpoint_storage  # noqa: E402
from tinymodel import make_model  # noqa: E402

# Through every ordered pair once: r->t, t->r, r->g, g->t, t->g, g->r.
PATH = [Role.TRAIN, Role.ROLLOUT, Role.JUDGE, Role.TRAIN, Role.JUDGE, Role.ROLLOUT]
HYPER = dict(lr=1e-4, weight_decay=0.0, grad_clip=1.0, temperature=1.0, micro_batch=8)


def memcpy_rate(nbytes: int, repeats: int) -> float:
    """Bytes per second of a warm copy of `nbytes` between two host buffers (best of `repeats`)."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    dst.copy_(src)  # first touch of every page, outside the timing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def measure(d, name: str, policy_dir: str, judge_dir: str, repeats: int, kv_bytes: int) -> tuple[dict, RoleContext]:
    """The set's figures, and its context: the caller keeps it (and so its engines) alive, since an
    engine going away tears down the default process group."""
    state = TrainState(d, policy_dir, keep_reference=False)
    policy = ParameterStorage(d, f"{name}-policy", state.weight_shapes(torch.float32))
    state.publish_weights(policy, version=0)
    judge = checkpoint_storage(d, f"{name}-judge", judge_dir, torch.float32)
    engines = {role: Engine(path, seed=0, max_model_len=256, kv_cache_bytes=kv_bytes)
               for role, path in ((Role.ROLLOUT, policy_dir), (Role.JUDGE, judge_dir))}
    ctx = RoleContext(d, [Role.ROLLOUT], policy=policy, judge=judge, train_state=state,
                      rollout_engine=engines[Role.ROLLOUT], judge_engine=engines[Role.JUDGE],
                      make_trainer=lambda group: PolicyTrainer(state, group, d.device, **HYPER))
    records, version = [], 0
    for _ in range(repeats):
        for role in PATH:
            if role == Role.ROLLOUT:  # as after an update: a new version for the engine to load
                version += 1
                state.publish_weights(policy, version=version)
            records += ctx.apply([role])
    pairs = {}
    for r in records:
        pairs.setdefault(f"{r['from']}->{r['to']}", []).append(r)
    summary = {pair: {key: statistics.median(r[key] for r in rs) for key in ("seconds", *STAGES, "bytes")}
               for pair, rs in pairs.items()}
    weight_bytes = policy.nbytes
    rate = memcpy_rate(weight_bytes, repeats=5)
    train_rate = statistics.median(s["bytes"] / s["onload"] for p, s in summary.items() if p.endswith("->train"))
    engine_rate = statistics.median(s["bytes"] / s["onload"] for p, s in summary.items() if p.endswith("->rollout"))
    first_build = next(r["onload"] for r in records if r["to"] == Role.TRAIN)
    pack = pack_rate(policy)
    return {"params": sum(math.prod(shape) for _, shape in state.params), "weight_bytes": weight_bytes,
            "threads": torch.get_num_threads(), "memcpy_GBps": rate / 1e9,
            "onload_GBps": train_rate / 1e9, "onload_ratio": train_rate / rate, "first_train_onload_s": first_build,
            "engine_onload_GBps": engine_rate / 1e9, "engine_onload_ratio": engine_rate / rate,
            "engine_pack_ratio": pack / rate if pack else None, "pairs": summary}, ctx


def pack_rate(storage: ParameterStorage) -> float | None:
    """Bytes per second at which vLLM-CPU packs 2-D weights into oneDNN's layout, as reload_weights does
    to every linear weight (and the tied head) of the engine: a floor under the engine's onload time that
    no faster copy out of storage lowers. None where vLLM has no oneDNN kernels."""
    from vllm import _custom_ops as ops
    if not getattr(ops, "_supports_onednn", False):
        return None
    weights = [w for _, w in storage.named_tensors() if w.dim() == 2]
    start = time.perf_counter()
    for w in weights:
        ops.create_onednn_mm(w.t(), 32)
    return sum(w.numel() * w.element_size() for w in weights) / (time.perf_counter() - start)



def print_table(figures: dict) -> None:
    for name, r in figures.items():
        print(f"\n{name}: {r['params'] / 1e6:.1f}M parameters, {r['weight_bytes'] / 2**20:.0f} MiB of weights, "
              f"memcpy {r['memcpy_GBps']:.2f} GB/s ({r['threads']} thread(s))")
        print(f"  storage -> train onload {r['onload_GBps']:.2f} GB/s = {r['onload_ratio']:.2f} x memcpy "
              f"(first arrival, building the trainer: {r['first_train_onload_s']:.2f} s); "
              f"storage -> vLLM engine {r['engine_onload_GBps']:.2f} GB/s = {r['engine_onload_ratio']:.2f} x memcpy")
        if r["engine_pack_ratio"] is not None:
            print(f"  vLLM-CPU's oneDNN packing of the same weights alone: {r['engine_pack_ratio']:.2f} x memcpy "
                  f"(the floor under the engine onload)")
        print(f"  {'shift':<18}{'total s':>9}" + "".join(f"{s:>9}" for s in STAGES) + f"{'MiB':>9}")
        for pair, s in sorted(r["pairs"].items()):
            print(f"  {pair:<18}{s['seconds']:>9.3f}" + "".join(f"{s[k]:>9.3f}" for k in STAGES)
                  + f"{s['bytes'] / 2**20:>9.1f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policy", default=str(ROOT / "models/arith-policy"))
    p.add_argument("--judge-model", default=str(ROOT / "models/arith-genrm"))
    p.add_argument("--repeats", type=int, default=3, help="passes through every shift pair")
    p.add_argument("--kv-cache-mb", type=int, default=32)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    d = init_distributed()
    figures, contexts = {}, []
    if (Path(args.policy) / "config.json").is_file() and (Path(args.judge_model) / "config.json").is_file():
        figures["built-in"], ctx = measure(d, "builtin", args.policy, args.judge_model, args.repeats, args.kv_cache_mb << 20)
        contexts.append(ctx)
    else:
        print(f"skipping the built-in models: no config.json in {args.policy} or {args.judge_model}")
    with tempfile.TemporaryDirectory() as tmp:
        # ~100M parameters; the judge is a second engine on the same weights.
        make_model(tmp, hidden=768, layers=8, intermediate=3072, vocab=32000)
        figures["qwen2-100m"], ctx = measure(d, "m100", tmp, tmp, args.repeats, args.kv_cache_mb << 20)
        contexts.append(ctx)
    print_table(figures)
    if args.json:
        result_files.write(args.json, figures)


if __name__ == "__main__":
    main()
