"""GPU check of the project's own pieces, on one GPU, without vLLM, in a few minutes. Each check passes
or fails and reports its figures:

  trainer      PolicyTrainer's GRPO steps over NCCL (a world of one: NCCL refuses two ranks on one
               device), on a policy made from a config (random weights): loss and gradient norm finite,
               the weights moved; the trainer's build from storage (the train state's onload)
  publish      publish_shards of the trainer's bf16 weight rows into the policy's storage (pinned host
               shared memory), which then holds them bit for bit
  device copy  share_on_device: the storage's device-resident copy, which must follow the next publish
               bit for bit
  train shift  RoleContext train -> rollout -> train with no engines: the state offloaded to storage and
               the trainer freed, then built again from storage, master weights, moments and step bit for
               bit; the device memory the offload frees
  CUDA IPC     a second process maps the storage's device copy through its CUDA IPC handle (as the other
               local ranks of a node do) and finds the same bytes; its device-to-device copy rate

    python bench/gpu_check.py [--json PATH] [--hidden 1024 --layers 16 --intermediate 4096 --vocab 32768]

Without CUDA it stops at once with a message saying so. Nothing it imports imports vLLM.
"""
import argparse
import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import result_files  # noqa: E402
from roles import Role  # noqa: E402
from roles.trainer import PolicyTrainer  # noqa: E402
from runtime import Dist, init_distributed, shutdown_distributed  # noqa: E402
from shifting.context import RoleContext  # noqa: E402
from storage import ParameterStorage, TrainState, export_cuda, import_cuda  # noqa: E402
from tinymodel import make_model  # noqa: E402

GiB = 1 << 30
HYPER = dict(lr=1e-5, weight_decay=0.0, grad_clip=1.0, temperature=1.0)
NO_CUDA = ("gpu_check: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine "
           "with a CUDA build of torch")


@dataclass
class TrainSample:
    """What PolicyTrainer.train_step reads of a sample (roles.rollout.Sample, whose module imports vLLM)."""
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    advantage: float
    pi_old: list[float] | None = None  # the rollout correction's, which this check leaves off


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn):
    """(fn's result, its seconds), the device's queued work included."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


def batch(vocab: int, samples: int, prompt: int, response: int, seed: int) -> list[TrainSample]:
    """GRPO samples of random tokens; the old logprobs are those of a uniform policy."""
    gen = torch.Generator().manual_seed(seed)
    return [TrainSample(torch.randint(0, vocab, (prompt,), generator=gen).tolist(),
                        torch.randint(0, vocab, (response,), generator=gen).tolist(),
                        [-math.log(vocab)] * response, 1.0 if i % 2 else -1.0) for i in range(samples)]


def weights(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    """Full inference-dtype weights on the host; collective over the train group."""
    return dict(trainer.full_weights())


def master_rows(trainer: PolicyTrainer) -> list[torch.Tensor]:
    """This rank's fp32 master rows (a step of lr 1e-5 may not show in bf16 weights)."""
    return [p.to_local().detach().clone() for p in trainer.model.parameters()]


def check_trainer(d: Dist, trainer: PolicyTrainer, steps: list[list[TrainSample]]) -> dict:
    before = master_rows(trainer)
    stats, seconds = [], []
    for samples in steps:
        result, s = timed(d.device, lambda: trainer.train_step([samples]))
        stats.append(result)
        seconds.append(s)
    moved = max((a - b).abs().max().item() for a, b in zip(master_rows(trainer), before) if a.numel())
    finite = all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) for s in stats)
    tokens = sum(len(s.response_ids) for s in steps[0])
    return {"ok": finite and moved > 0, "step_s": seconds, "response_tokens_per_step": tokens,
            "loss": [s["loss"] for s in stats], "grad_norm": [s["grad_norm"] for s in stats], "moved": moved}


def check_publish(d: Dist, trainer: PolicyTrainer, policy: ParameterStorage, version: int) -> dict:
    _, seconds = timed(d.device, lambda: policy.publish_shards(trainer.weight_rows(), version))
    full = weights(trainer)
    exact = policy.version == version and all(torch.equal(full[n], t) for n, t in policy.views.items())
    nbytes = policy.last_publish["bytes"]
    return {"ok": exact, "seconds": seconds, "bytes": nbytes, "GBps": nbytes / seconds / 1e9}


def check_device_copy(d: Dist, trainer: PolicyTrainer, policy: ParameterStorage, version: int) -> dict:
    """CUDA only: the device-resident copy, made and then following a publish."""
    _, share_s = timed(d.device, policy.share_on_device)
    policy.publish_shards(trainer.weight_rows(), version)
    exact = torch.equal(policy.device_buffer.cpu(), policy.buffer)
    nbytes = policy.nbytes
    return {"ok": exact, "share_s": share_s, "bytes": nbytes, "GBps": nbytes / share_s / 1e9}


def check_train_shift(d: Dist, ctx: RoleContext) -> dict:
    """train -> rollout -> train: offload to storage and free, then build again from storage."""
    before = [(name, rows.detach().clone(), first) for name, rows, first in ctx.trainer.state_rows()]
    allocated = torch.cuda.memory_allocated(d.device) if d.device.type == "cuda" else 0
    away, offload_s = timed(d.device, lambda: ctx.apply([Role.ROLLOUT] * d.world_size))
    freed = allocated - torch.cuda.memory_allocated(d.device) if d.device.type == "cuda" else 0
    back, onload_s = timed(d.device, lambda: ctx.apply([Role.TRAIN] * d.world_size))
    after = list(ctx.trainer.state_rows())
    exact = len(after) == len(before) and all(
        na == nb and fa == fb and torch.equal(ra, rb) for (na, ra, fa), (nb, rb, fb) in zip(after, before))
    nbytes = sum(rows.numel() * rows.element_size() for _, rows, _ in before)
    return {"ok": exact, "state_bytes": nbytes, "offload_s": offload_s, "offload_GBps": nbytes / offload_s / 1e9,
            "onload_s": onload_s, "onload_GBps": nbytes / onload_s / 1e9, "freed_GiB": freed / GiB,
            "stages": {"away": away, "back": back}}


def _ipc_child(handle, expected: int, results) -> None:
    torch.cuda.set_device(0)
    shared = import_cuda(handle)
    seen = int(shared.view(torch.int32).sum(dtype=torch.int64).item())
    local = torch.empty_like(shared)
    _, seconds = timed(shared.device, lambda: local.copy_(shared))
    results.put({"checksum_equal": seen == expected, "d2d_GBps": shared.numel() / seconds / 1e9})


def check_ipc(policy: ParameterStorage) -> dict:
    """CUDA only: another process maps the storage's device copy and reads the same bytes."""
    import torch.multiprocessing as mp
    expected = int(policy.device_buffer.view(torch.int32).sum(dtype=torch.int64).item())
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    start = time.perf_counter()
    child = ctx.Process(target=_ipc_child, args=(export_cuda(policy.device_buffer), expected, results))
    child.start()
    result = results.get(timeout=120)
    child.join(timeout=60)
    # The storage keeps the exported memory alive until here: the child's mapping needs it.
    return {"ok": result["checksum_equal"] and child.exitcode == 0, **result, "child_s": time.perf_counter() - start,
            "child_exit": child.exitcode}


def run(d: Dist, model_dir: str, args) -> dict:
    """Every check that `d.device` allows, in order (CUDA: all of them)."""
    state = TrainState(d, model_dir, keep_reference=False)

    def make_trainer(group):
        return PolicyTrainer(state, group, d.device, micro_batch=args.micro_batch, **HYPER)

    ctx, build_s = timed(d.device, lambda: RoleContext(
        d, [Role.TRAIN] * d.world_size, policy=None, judge=None, train_state=state, rollout_engine=None,
        judge_engine=None, make_trainer=make_trainer))
    policy = ParameterStorage(d, "gpu-check-policy", ctx.trainer.weight_shapes())
    steps = [batch(state.config.vocab_size, args.samples, args.prompt_tokens, args.response_tokens, seed)
             for seed in (0, 1)]
    checks = {"trainer": {**check_trainer(d, ctx.trainer, steps), "build_s": build_s,
                          "peak_memory_GiB": torch.cuda.max_memory_allocated(d.device) / GiB
                          if d.device.type == "cuda" else None},
              "publish": check_publish(d, ctx.trainer, policy, version=1)}
    if d.device.type == "cuda":
        checks["device copy"] = check_device_copy(d, ctx.trainer, policy, version=2)
    checks["train shift"] = check_train_shift(d, ctx)
    if d.device.type == "cuda":
        checks["CUDA IPC"] = check_ipc(policy)
    for held in (policy, state):
        held.close()
    return checks


def summary(name: str, check: dict) -> str:
    figures = {
        "trainer": lambda c: (f"build {c['build_s']:.2f} s, steps " + " ".join(f"{s:.2f}" for s in c["step_s"])
                              + f" s, loss {c['loss'][-1]:.3f}, moved {c['moved']:.2e}"),
        "publish": lambda c: f"{c['seconds']:.3f} s, {c['GBps']:.1f} GB/s",
        "device copy": lambda c: f"{c['share_s']:.3f} s, {c['GBps']:.1f} GB/s",
        "train shift": lambda c: (f"offload {c['offload_s']:.2f} s ({c['offload_GBps']:.1f} GB/s), onload "
                                  f"{c['onload_s']:.2f} s ({c['onload_GBps']:.1f} GB/s), "
                                  f"freed {c['freed_GiB']:.1f} GiB"),
        "CUDA IPC": lambda c: f"child D2D {c['d2d_GBps']:.1f} GB/s, exit {c['child_exit']}",
    }
    return f"  {name:<13}{'PASS' if check['ok'] else 'FAIL'}  {figures[name](check)}"


def shm_needed(params: int) -> int:
    """Host shared memory for the check: the fp32 train state (master weights and two moments) and the bf16
    weights, with a margin for alignment and the frozen buffers."""
    return int(params * (3 * 4 + 2) * 1.05)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--samples", type=int, default=16, help="samples per train step")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--response-tokens", type=int, default=448)
    p.add_argument("--micro-batch", type=int, default=8)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit(NO_CUDA)
    with tempfile.TemporaryDirectory() as tmp:
        params = make_model(tmp, hidden=args.hidden, layers=args.layers, intermediate=args.intermediate,
                            vocab=args.vocab, config_only=True)
        free = shutil.disk_usage("/dev/shm").free
        if free < shm_needed(params):
            sys.exit(f"gpu_check: /dev/shm has {free / GiB:.1f} GiB free and the storage needs "
                     f"{shm_needed(params) / GiB:.1f} GiB: lower --layers or --hidden, or give the machine (or "
                     f"container: docker --shm-size) more shared memory")
        make_model(tmp, hidden=args.hidden, layers=args.layers, intermediate=args.intermediate, vocab=args.vocab)
        d = init_distributed()
        figures = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "nccl": ".".join(map(str, torch.cuda.nccl.version())), "params": params,
                   "checks": run(d, tmp, args)}
        shutdown_distributed(d)
    print(f"{figures['device']}, torch {figures['torch']}, NCCL {figures['nccl']}, "
          f"policy of {params / 1e6:.0f}M parameters")
    for name, check in figures["checks"].items():
        print(summary(name, check))
    if args.json:
        result_files.write(args.json, figures)
    if not all(c["ok"] for c in figures["checks"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
