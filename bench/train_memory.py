"""Memory of one train step beyond the weights, gradients and optimizer state, on CPU (fp32), for a
~100M-parameter Qwen2 policy with a 32k vocabulary built from a config (random weights):

  baseline: full-vocabulary log-softmax   fp32 logits at every position, prompt included, and a
                                          log-softmax over the whole vocabulary (written out below)
  response-only, chunked                  the trainer's `response_logprobs`
  ... + activation checkpointing          the same with `--activation-checkpointing`

    python bench/train_memory.py [--json PATH] [--prompt 256 --response 768 --micro-batch 8]

Each configuration runs in a fresh process (a world of one, FSDP2 over it, the project's
`PolicyTrainer`): one train step on one micro-batch. Memory is the c10 CPU allocator's own tally,
through torch.profiler's memory events (every allocation and free of a tensor's storage, with its size,
in order): its running sum is the memory live in tensors at each moment, and its maximum during the
step, the step's peak. It starts before the trainer is built, so the weights, moments and everything
the trainer allocates count, and nothing freed during the step is of unknown size. VmHWM (the
process's peak resident memory) would also count the profiler's own buffers, the pages of the
parameter storage in shared memory that building the trainer reads, and what glibc's malloc keeps
after a free, so it would overstate the step and depend on the allocator's trimming.

The dry run's train figure (`dryrun.train_memory`, given fp32 and one rank) is printed beside the
measured peak: it must not be below it, and within 25% above.
"""
import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import result_files  # noqa: E402

MIB = 1 << 20
CONFIGS = {
    "baseline: full-vocabulary log-softmax": dict(method="full", activation_checkpointing=False),
    "response-only, chunked": dict(method="response", activation_checkpointing=False),
    "response-only, chunked, activation checkpointing": dict(method="response", activation_checkpointing=True),
}
HYPER = dict(lr=1e-4, weight_decay=0.0, grad_clip=1.0, temperature=1.0)


def make_policy(out: Path) -> int:
    """A Qwen2 of about 100M parameters with a 32k vocabulary, head_dim 64, tied embeddings."""
    from transformers import AutoModelForCausalLM

    from tinymodel import make_config
    config = make_config("qwen2", hidden=768, layers=12, intermediate=2048, vocab=32000, init_std=0.02)
    config.max_position_embeddings = 4096
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def full_vocabulary_trainer():
    """The baseline, as a PolicyTrainer whose logprobs are fp32 logits at every position and a
    log-softmax over the whole vocabulary."""
    from roles.trainer import PolicyTrainer

    class FullVocabulary(PolicyTrainer):
        def logprobs(self, model, batch):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
            logp = torch.log_softmax(logits / self.temperature, dim=-1)
            return logp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    return FullVocabulary


def bench_samples(vocab: int, count: int, prompt: int, response: int):
    from roles.rollout import Sample
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(count):
        ids = torch.randint(2, vocab, (prompt + response,), generator=g).tolist()
        s = Sample(i, 0, ids[:prompt], ids[prompt:], [-math.log(vocab)] * response, "stop")
        s.advantage = 1.0 if i % 2 else -1.0
        samples.append(s)
    return samples


def live_bytes(prof) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(time, bytes live) after each allocator event, and the (start, end) of the train step."""
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    step = next(e for e in events if e.name() == "train_step")
    live, timeline = 0, []
    for e in events:
        if e.name() == "[memory]":
            live += e.nbytes()
            timeline.append((e.start_ns(), live))
    return timeline, (step.start_ns(), step.start_ns() + step.duration_ns())


def measure(name: str, model_dir: str, prompt: int, response: int, micro_batch: int) -> dict:
    """One configuration, in this process: one train step, and the allocator's figures."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from roles.trainer import PolicyTrainer
    from runtime import init_distributed, shutdown_distributed
    from storage import TrainState
    config = CONFIGS[name]
    d = init_distributed()
    state = TrainState(d, model_dir, keep_reference=False)
    samples = bench_samples(state.config.vocab_size, micro_batch, prompt, response)
    cls = full_vocabulary_trainer() if config["method"] == "full" else PolicyTrainer
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer = cls(state, d.tensors, d.device, micro_batch=micro_batch,
                      activation_checkpointing=config["activation_checkpointing"], **HYPER)
        with record_function("train_step"):
            trainer.train_step([samples])
    timeline, (start, end) = live_bytes(prof)
    params = list(trainer.model.parameters())
    weights = sum(p.to_local().numel() * p.element_size() for p in params)
    grads = sum(p.grad.to_local().numel() * p.grad.element_size() for p in params)
    moments = sum(trainer.optimizer.state[p][k].to_local().numel() * 4
                  for p in params for k in ("exp_avg", "exp_avg_sq"))
    peak = max(live for t, live in timeline if start <= t <= end)
    trainer.close()
    state.close()
    shutdown_distributed(d)
    return {"config": name, "peak_bytes": peak, "at_step_start_bytes": [live for t, live in timeline if t < start][-1],
            "weights_bytes": weights, "grads_bytes": grads, "moments_bytes": moments,
            "beyond_state_bytes": peak - weights - grads - moments}


def dry_run_bytes(model_dir: str, prompt: int, response: int, micro_batch: int, activation_checkpointing: bool) -> int:
    """The dry run's train figure for this step, in the trainer's CPU dtypes (fp32) on one rank."""
    import argparse

    import dryrun
    summary = dryrun.model_summary(model_dir, torch.float32)
    shape = dryrun.micro_batch_shape(argparse.Namespace(micro_batch=micro_batch, micro_batch_tokens=0,
                                                        max_model_len=prompt + response, max_response_tokens=response))
    parts, _ = dryrun.train_memory(summary, 1, shape, activation_checkpointing=activation_checkpointing, kl=False,
                                   device="cpu")
    return sum(parts.values())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens per sample")
    p.add_argument("--response", type=int, default=768, help="response tokens per sample")
    p.add_argument("--micro-batch", type=int, default=8, help="samples in the step (one micro-batch)")
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.model, args.prompt, args.response, args.micro_batch)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        params = make_policy(Path(tmp))
        rows = []
        for name, config in CONFIGS.items():
            proc = subprocess.run([sys.executable, __file__, "--measure", name, "--model", tmp,
                                   "--prompt", str(args.prompt), "--response", str(args.response),
                                   "--micro-batch", str(args.micro_batch)], capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{name}: the measuring process failed\n{proc.stderr[-4000:]}")
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            if config["method"] == "response":
                row["dry_run_bytes"] = dry_run_bytes(tmp, args.prompt, args.response, args.micro_batch,
                                                     config["activation_checkpointing"])
            rows.append(row)
    report(rows, params, args)


def report(rows: list[dict], params: int, args) -> None:
    base = rows[0]["beyond_state_bytes"]
    for r in rows:
        r["less_than_baseline"] = base / r["beyond_state_bytes"]
        if "dry_run_bytes" in r:
            r["dry_run_over_peak"] = r["dry_run_bytes"] / r["peak_bytes"]
    first = rows[0]
    print(f"one train step, one rank, fp32: Qwen2 of {params / 1e6:.1f}M parameters, vocabulary 32000; "
          f"{args.micro_batch} samples of {args.prompt} prompt + {args.response} response tokens")
    print(f"state: weights {first['weights_bytes'] / MIB:.0f} MiB, gradients {first['grads_bytes'] / MIB:.0f} MiB, "
          f"AdamW moments {first['moments_bytes'] / MIB:.0f} MiB (the allocator's tally, MiB below)")
    print(f"  {'configuration':50s} {'peak':>7s} {'beyond state':>13s} {'x less':>7s} {'dry run':>8s} "
          f"{'dry run/peak':>13s}")
    for r in rows:
        dry = (f"{r['dry_run_bytes'] / MIB:8.0f} {r['dry_run_over_peak']:13.2f}" if "dry_run_bytes" in r
               else f"{'-':>8s} {'-':>13s}")
        print(f"  {r['config']:50s} {r['peak_bytes'] / MIB:7.0f} {r['beyond_state_bytes'] / MIB:13.0f} "
              f"{r['less_than_baseline']:7.1f} {dry}")
    best = rows[-1]["less_than_baseline"]
    within = all(1.0 <= r["dry_run_over_peak"] <= 1.25 for r in rows if "dry_run_bytes" in r)
    print(f"beyond the state, the trainer with activation checkpointing needs {best:.1f}x less than the baseline "
          f"({'at least' if best >= 3 else 'less than'} 3x); the dry run is {'' if within else 'not '}within "
          f"[1, 1.25] of each measured peak")
    if args.json:
        result_files.write(args.json, {"params": params, "prompt": args.prompt, "response": args.response,
                                               "micro_batch": args.micro_batch, "rows": rows,
                                               "at_least_3x_less": best >= 3, "dry_run_within_25_percent": within})


if __name__ == "__main__":
    main()
