"""GPU check of the storage's device path, on one GPU, without vLLM, in a few minutes:

  1. pinned host <-> device copy rates (1 GiB each way)
  2. the storage's offload (device -> pinned shared memory) and onload (back) of a Qwen2-1.5B-shaped
     policy (random weights, bf16) out of and into a transformers model, checked bit for bit; then
     onload from the storage's device-resident copy (share_on_device)
  3. a CUDA IPC share between two processes: a child maps the parent's device tensor, checks it and
     copies it device to device
  4. two FSDP2 train steps (bf16 compute, fp32 master, AdamW) of that model on one GPU

    python bench/gpu_check.py [--json PATH]

Without CUDA it stops at once with a message saying so.
"""
import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

GiB = 1 << 30


def qwen2_1p5b_config():
    from transformers import Qwen2Config
    return Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                       max_position_embeddings=4096, tie_word_embeddings=True)


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def pinned_rates(nbytes: int = GiB, repeats: int = 5) -> dict:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = min(timed(lambda: device.copy_(host, non_blocking=True)) for _ in range(repeats))
    d2h = min(timed(lambda: host.copy_(device, non_blocking=True)) for _ in range(repeats))
    return {"h2d_GBps": nbytes / h2d / 1e9, "d2h_GBps": nbytes / d2h / 1e9}


def storage_round_trip(d, config) -> dict:
    from transformers import AutoModelForCausalLM

    from storage import ParameterStorage
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    storage = ParameterStorage(d, "gpu-check", [(n, tuple(p.shape), p.dtype) for n, p in params.items()])
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    before = {n: p.detach().clone() for n, p in params.items()}
    offload = timed(lambda: storage.publish(((n, p.detach()) for n, p in params.items()), version=1))

    def onload(source):
        with torch.no_grad():
            for name, tensor in source:
                params[name].copy_(tensor, non_blocking=True)

    with torch.no_grad():
        for p in params.values():
            p.zero_()
    host_onload = timed(lambda: onload(storage.named_tensors()))
    host_exact = all(torch.equal(params[n], t) for n, t in before.items())
    storage.share_on_device()
    with torch.no_grad():
        for p in params.values():
            p.zero_()
    device_onload = timed(lambda: onload(storage.named_tensors()))  # now the device copy's views
    device_exact = all(torch.equal(params[n], t) for n, t in before.items())
    storage.close()
    return {"params": sum(p.numel() for p in params.values()), "bytes": nbytes,
            "offload_s": offload, "offload_GBps": nbytes / offload / 1e9,
            "onload_s": host_onload, "onload_GBps": nbytes / host_onload / 1e9, "onload_exact": host_exact,
            "device_copy_onload_s": device_onload, "device_copy_onload_GBps": nbytes / device_onload / 1e9,
            "device_copy_exact": device_exact}


def _ipc_child(handle, results) -> None:
    from storage import import_cuda
    torch.cuda.set_device(0)
    shared = import_cuda(handle)
    ok = bool((shared == 7).all().item())
    local = torch.empty_like(shared)
    seconds = min(timed(lambda: local.copy_(shared)) for _ in range(5))
    results.put({"ok": ok, "d2d_GBps": shared.numel() / seconds / 1e9})


def ipc_share(nbytes: int = GiB) -> dict:
    import torch.multiprocessing as mp

    from storage import export_cuda
    tensor = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    start = time.perf_counter()
    child = ctx.Process(target=_ipc_child, args=(export_cuda(tensor), results))
    child.start()
    result = results.get(timeout=120)
    child.join(timeout=60)
    # `tensor` stays alive until here: the child's mapping needs the parent's memory.
    return {**result, "child_s": time.perf_counter() - start, "child_exit": child.exitcode}


def fsdp_steps(d, config, steps: int = 2, batch: int = 4, seq: int = 1024) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    mesh = DeviceMesh.from_group(d.tensors, "cuda")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device="cuda")
    times, losses = [], []

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())

    for _ in range(steps):
        times.append(timed(step))
    return {"step_s": times, "losses": losses, "tokens_per_step": batch * seq,
            "peak_memory_GiB": torch.cuda.max_memory_allocated() / GiB}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU "
                 "machine with a CUDA build of torch")
    from runtime import init_distributed, shutdown_distributed
    d = init_distributed()
    config = qwen2_1p5b_config()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    results["pinned"] = pinned_rates()
    results["storage"] = storage_round_trip(d, config)
    torch.cuda.empty_cache()
    results["ipc"] = ipc_share()
    torch.cuda.empty_cache()
    results["fsdp"] = fsdp_steps(d, config)
    shutdown_distributed(d)

    s, f = results["storage"], results["fsdp"]
    rows = [("pinned host -> device", f"{results['pinned']['h2d_GBps']:.1f} GB/s"),
            ("pinned device -> host", f"{results['pinned']['d2h_GBps']:.1f} GB/s"),
            (f"storage offload, {s['params'] / 1e9:.2f}B bf16", f"{s['offload_s']:.3f} s  {s['offload_GBps']:.1f} GB/s"),
            ("storage onload (pinned host)", f"{s['onload_s']:.3f} s  {s['onload_GBps']:.1f} GB/s  exact={s['onload_exact']}"),
            ("storage onload (device copy)", f"{s['device_copy_onload_s']:.3f} s  "
                                             f"{s['device_copy_onload_GBps']:.1f} GB/s  exact={s['device_copy_exact']}"),
            ("CUDA IPC share, child process", f"ok={results['ipc']['ok']}  D2D {results['ipc']['d2d_GBps']:.1f} GB/s  "
                                              f"exit {results['ipc']['child_exit']}"),
            ("FSDP2 train steps", "  ".join(f"{t:.2f} s" for t in f["step_s"])
             + f"  loss {f['losses'][-1]:.3f}  peak {f['peak_memory_GiB']:.1f} GiB")]
    print(f"{results['device']}, torch {results['torch']}")
    for name, value in rows:
        print(f"  {name:<34}{value}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
