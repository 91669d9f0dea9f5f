"""The three placements on one task, models, seed and world size, in one invocation, interleaved.

    python bench/placements.py [--nproc 4] [--repeats 3] [--steps 10] [--split rollout=2,genrm=1,train=1]
                               [--json PATH] [-- extra pivot_train.py flags]

Each run is `torchrun --nproc_per_node NPROC pivot_train.py --placement P` with the same flags; runs
go colocated, disaggregated, pivot, colocated, ... so that the machine's drift hits all three alike.
Per placement it prints the median over repeats of samples/s and tokens/s (measured over each run's
steps after the first, which warms the engines), each role's busy fraction (busy seconds over ranks x
step time), the ratios pivot/colocated and pivot/disaggregated, and the reward curves side by side.

Lengths: on the built-in task a response is a worked column-by-column sum, so its length grows with
the operands' digit counts (1 to 4 each, drawn independently): 6 to 39 tokens; a critique quotes both
answers and compares them digit by digit: 40 to 70 tokens. Pass larger models and data of your own
after `--` for longer tails.
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLACEMENTS = ("colocated", "disaggregated", "pivot")


def run(placement: str, args, extra: list[str], out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(ROOT / "pivot_train.py"), "--placement", placement, "--steps", str(args.steps),
           "--eval-every", str(args.steps), "--eval-prompts", "32", "--seed", str(args.seed), "--out", str(out),
           *(["--split", args.split] if placement == "disaggregated" else []), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{placement} run failed ({' '.join(cmd)}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summarise(records: list[dict], nproc: int) -> dict:
    steps = [r for r in records if "samples_per_s" in r][1:]
    seconds = sum(r["step_time_s"] for r in steps)
    busy = {role: sum(r["busy_s"][role] for r in steps) / (nproc * seconds) for role in ("rollout", "genrm", "train")}
    return {"samples_per_s": sum(r["samples"] for r in steps) / seconds,
            "tokens_per_s": sum(r["tokens_per_s"] * r["step_time_s"] for r in steps) / seconds,
            "busy": busy, "shifts": sum(len(r["shifts"]) for r in steps) / len(steps),
            "rewards": [r["reward_mean"] for r in records if "reward_mean" in r]}


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", default="rollout=2,genrm=1,train=1")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)

    results = {placement: [] for placement in PLACEMENTS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for placement in PLACEMENTS:
                records = run(placement, args, extra, Path(tmp) / f"{placement}-{repeat}")
                results[placement].append(summarise(records, args.nproc))
                print(f"repeat {repeat} {placement:13s} {results[placement][-1]['samples_per_s']:7.1f} samples/s",
                      flush=True)

    table = {}
    for placement, runs in results.items():
        median = statistics.median(r["samples_per_s"] for r in runs)
        table[placement] = {
            "samples_per_s": median, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "busy": {role: statistics.median(r["busy"][role] for r in runs) for role in ("rollout", "genrm", "train")},
            "shifts_per_step": statistics.median(r["shifts"] for r in runs),
            "rewards": runs[0]["rewards"], "runs": runs}
    figures = {"nproc": args.nproc, "steps": args.steps, "repeats": args.repeats, "split": args.split,
               "placements": table,
               "pivot_over_colocated": table["pivot"]["samples_per_s"] / table["colocated"]["samples_per_s"],
               "pivot_over_disaggregated": table["pivot"]["samples_per_s"] / table["disaggregated"]["samples_per_s"]}

    print(f"\n{'placement':14s} {'samples/s':>10s} {'tokens/s':>10s} {'rollout':>8s} {'genrm':>8s} {'train':>8s} "
          f"{'shifts/step':>12s}")
    for placement, row in table.items():
        b = row["busy"]
        print(f"{placement:14s} {row['samples_per_s']:10.1f} {row['tokens_per_s']:10.1f} {b['rollout']:8.2f} "
              f"{b['genrm']:8.2f} {b['train']:8.2f} {row['shifts_per_step']:12.1f}")
    print(f"\npivot / colocated      {figures['pivot_over_colocated']:.2f}x")
    print(f"pivot / disaggregated  {figures['pivot_over_disaggregated']:.2f}x")
    print("\nreward per step (first repeat)")
    print("step " + " ".join(f"{p:>13s}" for p in PLACEMENTS))
    for step in range(args.steps):
        print(f"{step:4d} " + " ".join(f"{table[p]['rewards'][step]:13.3f}" for p in PLACEMENTS))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
