"""The three placements on one task, models, seed and world size, in one invocation, interleaved.

    python bench/placements.py [--nproc 4] [--repeats 3] [--steps 10] [--split rollout=2,judge=1,train=1]
                               [--max-staleness 0,2] [--workload task|longtail] [--json PATH] [--out DIR]
                               [-- extra pivot_train.py flags]

Each run is `torchrun --nproc_per_node NPROC pivot_train.py --placement P --max-staleness K` with the
same flags, for every placement and every K of the list; runs go colocated@0, disaggregated@0,
pivot@0, colocated@2, ... in each repeat, so that the machine's drift hits all alike. Per run it
prints the median over repeats of samples/s and tokens/s (measured over each run's steps after the
first, which warms the engines and, at K > 0, also rolls out the K steps before the first update, and
before the last K, which roll nothing out; at every K over the updates that roll out the same steps),
each role's busy fraction (busy seconds over ranks x step
time), the ratios pivot@K / colocated@0, pivot@K / disaggregated@K and pivot@0 / colocated@0 (the
median over repeats of each repeat's own ratio), and the reward curves side by side.

Cost model (for `python -m sim --calibration cpu --measured PATH`): from the same runs' metrics.jsonl,
samples.jsonl and config.json it fits each engine role's step time, seconds = fixed + per_seq x batch,
by least squares over the decode-only engine steps, the prefill rate from the steps that also took in
requests, each role's training tokens/s per rank, the shift cost of each (from, to) pair (median of
the shift records of every run, at every K; the rest from the runs at K = 0), and keeps the lengths
seen (in the runs' group order, each critique beside its response: the simulator draws whole groups)
and the flags. Several ranks share few cores here: a step measured while k ranks worked on c
cores (stepped their engines or trained) is counted as max(1, k / c) times its uncontended time, the
same law the simulator applies. Each run's machine-wide CPU busy fraction (/proc/stat before and
after) bounds what any placement can gain over colocated: 1 / its busy fraction.

Rounds (for `python -m sim.replay PATH` and tests/unit/test_replay.py): every run goes with
--trace-rounds, and the JSON keeps each run's rounds.jsonl from the first repeat under `rounds`.

Lengths: on the built-in task a response is a worked column-by-column sum, so its length grows with
the operands' digit counts (1 to 4 each, drawn independently): 6 to 39 tokens; a critique quotes both
answers and compares them digit by digit: 40 to 70 tokens. There is no tail to speak of. `--workload
longtail` draws each response's and critique's length instead (tasks/longtail.py: log-normal, p99 at
the budget, 96 tokens each unless given after `--`), a throughput workload whose rewards mean nothing.

A placement that cannot be placed on --nproc ranks (disaggregated needs a rank per role, so three or
more) is skipped with a line that says so.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from planner import parse_split  # noqa: E402
import result_files  # noqa: E402
from roles import Role  # noqa: E402
from runtime import busy_fraction, cpu_ticks  # noqa: E402
from sim.calibration import shared_cores  # noqa: E402
from tasks.longtail import LABEL  # noqa: E402
PLACEMENTS = ("colocated", "disaggregated", "pivot")
LONGTAIL = ["--workload", "longtail", "--max-response-tokens", "96", "--max-critique-tokens", "96"]


def run(placement: str, staleness: int, args, extra: list[str], out: Path) -> tuple[list[dict], float]:
    """One run's metrics records and the machine's CPU busy fraction while it ran."""
    before = cpu_ticks()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(ROOT / "pivot_train.py"), "--placement", placement, "--max-staleness", str(staleness),
           "--steps", str(args.steps),
           "--eval-every", str(args.steps), "--eval-prompts", "32", "--seed", str(args.seed), "--out", str(out),
           "--trace-rounds",
           *(["--split", args.split] if placement == "disaggregated" else []),
           *(LONGTAIL if args.workload == "longtail" else []), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    after = cpu_ticks()
    if proc.returncode != 0:
        sys.exit(f"{placement} run failed ({' '.join(cmd)}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return read_jsonl(out / "metrics.jsonl"), busy_fraction(before, after)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def fit_line(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Weighted least squares of y = fixed + slope x over (x, y, weight) points."""
    w = sum(p[2] for p in points)
    x, y = sum(p[0] * p[2] for p in points) / w, sum(p[1] * p[2] for p in points) / w
    xx = sum((p[0] - x) ** 2 * p[2] for p in points)
    slope = sum((p[0] - x) * (p[1] - y) * p[2] for p in points) / xx if xx > 0 else 0.0
    return y - slope * x, slope


def cost_model(folders: list[Path], nproc: int, cpus: int) -> dict:
    """What the simulator's CpuModel needs (sim/calibration.py CPU_MEASURED), from the runs' files, each
    run's first step (the engines' warm-up) left out: the shifts from every run (a bounded-staleness run
    makes shifts an on-policy one does not), the rest from the on-policy runs."""
    steps, samples, shifts, train, placed = [], [], {}, {}, {}
    for folder in folders:
        config = json.loads((folder / "config.json").read_text())
        records = [r for r in read_jsonl(folder / "metrics.jsonl") if "samples_per_s" in r][1:]
        for r in records:
            for shift in r["shifts"]:
                shifts.setdefault(f"{shift['from']}->{shift['to']}", []).append(shift["seconds"])
        if config["max_staleness"]:
            continue
        logged = [s for s in read_jsonl(folder / "samples.jsonl") if s["step"] in {r["step"] for r in records}]
        steps += records
        placed.setdefault(config["placement"], []).extend(records)
        samples += logged
        # Training: the tokens of the steps trained all at the end over the train ranks' busy seconds.
        # Nothing else runs during that update, so all `ranks` train ranks are busy together; a step
        # that trained early mixes train groups of other sizes, busy beside engines, and is left out.
        split = dict(part.split("=") for part in config["split"].split(",")) if config["split"] else {}
        ranks = int(split.get(Role.TRAIN, nproc))
        whole = {r["step"] for r in records if not r.get("early_trained_groups")}
        tokens = sum(s["prompt_tokens"] + s["response_tokens"] for s in logged if s["step"] in whole)
        seconds = sum(r["busy_s"][Role.TRAIN] for r in records if r["step"] in whole) / shared_cores(ranks, cpus)
        t = train.setdefault(ranks, [0, 0.0])
        t[0], t[1] = t[0] + tokens, t[1] + seconds
    out = {"cpus": cpus, "max_seqs": config["max_seqs"], "round_steps": config["round_steps"],
           "prompts_per_step": config["prompts_per_step"],
           "group_size": config["group_size"], "max_response_tokens": config["max_response_tokens"],
           "max_critique_tokens": config["max_critique_tokens"],
           "prompt_tokens": statistics.mean(s["prompt_tokens"] for s in samples),
           # The judge's template around prompt and response: what its prompt adds to theirs.
           "judge_template_tokens": statistics.mean(s["judge_prompt_tokens"] - s["prompt_tokens"] - s["response_tokens"]
                                                    for s in samples),
           "response_lengths": [s["response_tokens"] for s in samples],
           "critique_lengths": [s["critique_tokens"] for s in samples],
           "shift_s": {pair: statistics.median(seconds) for pair, seconds in sorted(shifts.items())},
           "shift_counts": {pair: len(seconds) for pair, seconds in sorted(shifts.items())},
           "train_tokens_per_s_by_ranks": {n: tokens / seconds for n, (tokens, seconds) in sorted(train.items())
                                           if seconds > 0}}
    for role in (Role.ROLLOUT, Role.JUDGE):
        rows = [row for r in steps for row in r["engine_steps"][role]]  # [busy ranks, batch, steps, s, prefill]
        decode = [(b, s / n / shared_cores(k, cpus), n) for k, b, n, s, tokens in rows if not tokens]
        fixed, per_seq = fit_line(decode)
        # Prefill: what the steps that took in requests cost beyond the decode fit.
        extra = sum(s / shared_cores(k, cpus) - n * (fixed + per_seq * b) for k, b, n, s, tokens in rows if tokens)
        prefilled = sum(row[4] for row in rows)
        out |= {f"{role}_step_s": fixed, f"{role}_per_seq_s": per_seq,
                f"{role}_prefill_per_s": prefilled / extra if extra > 0 else None,
                f"{role}_engine_steps": sum(row[2] for row in rows)}
        # The contention law checked: mean measured step beside the fit x max(1, k / c), per k ranks working.
        out[f"{role}_by_busy_ranks"] = {}
        for k in sorted({row[0] for row in rows}):
            level = [row for row in rows if row[0] == k]
            n = sum(row[2] for row in level)
            out[f"{role}_by_busy_ranks"][k] = {
                "steps": n, "measured_s": sum(row[3] for row in level) / n,
                "predicted_s": sum(row[2] * (fixed + per_seq * row[1]) for row in level) * shared_cores(k, cpus) / n}
            # The same of the decode-only steps, which the fit is of: what sharing the cores costs beyond the law
            decoding = [row for row in level if not row[4]]
            if decoding:
                n = sum(row[2] for row in decoding)
                out[f"{role}_by_busy_ranks"][k] |= {
                    "decode_steps": n, "decode_measured_s": sum(row[3] for row in decoding) / n,
                    "decode_predicted_s": sum(row[2] * (fixed + per_seq * row[1]) for row in decoding)
                    * shared_cores(k, cpus) / n}
    # The rounds: what one costs beyond its busiest rank's engine steps, the planner's time and the shifts
    # made in it (the ranks' exchange with rank 0), and per placement the planner's time and a whole round.
    # Each per placement: timed rounds (disaggregated, pivot; their ranks agree on the round's end through
    # the launch's store) and colocated's run-until-empty ones cost differently beyond their engine steps.
    for key, seconds in (("exchange_per_round_s", "exchange_s"), ("plan_per_round_s", "plan_s"),
                         ("round_mean_s", "rollout_judge_s")):
        out[key] = {p: sum(r[seconds] for r in placed[p]) / sum(r["rounds"] for r in placed[p]) for p in placed}
    return out


def summarise(records: list[dict], nproc: int, staleness: int, largest: int) -> dict:
    """The run's steady updates: those that roll out the steps from 1 + `largest` (the largest K of the
    bench) to the last, so that runs at every K are timed over the rollout of the same steps (update u
    rolls out step u + K; the first update also rolls out the K before it, the last K roll out none)."""
    steps = [r for r in records if "samples_per_s" in r]
    steps = steps[1 + largest - staleness:len(steps) - staleness]
    seconds = sum(r["step_time_s"] for r in steps)
    busy = {role: sum(r["busy_s"][role] for r in steps) / (nproc * seconds) for role in (Role.ROLLOUT, Role.JUDGE, Role.TRAIN)}
    return {"samples_per_s": sum(r["samples"] for r in steps) / seconds,
            "tokens_per_s": sum(r["tokens_per_s"] * r["step_time_s"] for r in steps) / seconds,
            "busy": busy, "shifts": sum(len(r["shifts"]) for r in steps) / len(steps),
            # The machine's busy fraction during the measured steps (every process on it counted).
            "steps_cpu_busy": sum(r["cpu_busy"] * r["step_time_s"] for r in steps) / seconds,
            "exchange_share": sum(r["exchange_s"] for r in steps) / sum(r["rollout_judge_s"] for r in steps),
            "rewards": [r["reward_mean"] for r in records if "reward_mean" in r]}


def label(placement: str, staleness: int) -> str:
    return f"{placement}@{staleness}"


def repeat_ratios(results: dict, a: str, b: str) -> list[float]:
    """a's samples/s over b's in each repeat: runs next to each other in time share the machine's drift,
    which a ratio of the placements' own medians would not cancel. Their median is the bench's ratio;
    their spread says how far to trust it (single repeats here differ by 20-30%)."""
    return [x["samples_per_s"] / y["samples_per_s"] for x, y in zip(results[a], results[b])]


def placeable(args) -> dict[str, str]:
    """The placements to run, each against why another is skipped (a split that does not fit)."""
    skipped = {}
    try:
        if Role.TRAIN not in parse_split(args.split, args.nproc):
            skipped["disaggregated"] = f"--split {args.split} has no train rank"
    except ValueError as e:
        skipped["disaggregated"] = str(e)
    return skipped


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", default=None,
                   help="disaggregated's ranks per role (default: rollout=NPROC-2,judge=1,train=1)")
    p.add_argument("--max-staleness", default="0",
                   help="comma-separated K values: every placement runs at each (e.g. 0,2)")
    p.add_argument("--workload", choices=["task", "longtail"], default="task")
    p.add_argument("--json", default=None)
    p.add_argument("--out", default=None, help="keep the runs' directories here (default: a temporary one)")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.split = args.split or f"rollout={max(args.nproc - 2, 1)},judge=1,train=1"
    try:
        bounds = sorted({int(k) for k in args.max_staleness.split(",")})
    except ValueError:
        bounds = [-1]
    if min(bounds) < 0 or args.steps <= max(bounds) + 1:
        sys.exit(f"--max-staleness {args.max_staleness}: pass K values of 0 or more, separated by commas, each at "
                 f"most --steps - 2 (a run needs a steady step between its first and its last K)")
    if args.workload == "longtail":
        print(LABEL)
    skipped = placeable(args)
    for placement, why in skipped.items():
        print(f"{placement} skipped on {args.nproc} ranks: {why}")
    placements = [p for p in PLACEMENTS if p not in skipped]

    configs = [(placement, k) for k in bounds for placement in placements]
    results = {label(*config): [] for config in configs}
    cpus = os.cpu_count()
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(args.out or tmp)
        folders = []  # every run, which the simulator's cost model is fitted on
        rounds = {}  # each run's rounds, as its rank 0 read and ordered them (first repeat): sim/replay.py
        for repeat in range(args.repeats):
            for placement, k in configs:
                name = label(placement, k)
                folder = runs / f"{placement}-k{k}-{repeat}"
                records, cpu_busy = run(placement, k, args, extra, folder)
                folders.append(folder)
                if repeat == 0:
                    rounds[name] = read_jsonl(folder / "rounds.jsonl")
                results[name].append(summarise(records, args.nproc, k, max(bounds)) | {"cpu_busy": cpu_busy})
                r = results[name][-1]
                print(f"repeat {repeat} {name:16s} {r['samples_per_s']:7.1f} samples/s, CPU busy "
                      f"{r['steps_cpu_busy']:.0%} in its steps, {cpu_busy:.0%} over the run", flush=True)
        model = cost_model(folders, args.nproc, cpus) if 0 in bounds else {}  # fitted on the runs at K = 0

    table = {}
    for placement, runs in results.items():
        median = statistics.median(r["samples_per_s"] for r in runs)
        table[placement] = {
            "samples_per_s": median, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "busy": {role: statistics.median(r["busy"][role] for r in runs) for role in (Role.ROLLOUT, Role.JUDGE, Role.TRAIN)},
            "shifts_per_step": statistics.median(r["shifts"] for r in runs),
            "cpu_busy": statistics.median(r["cpu_busy"] for r in runs),
            "steps_cpu_busy": statistics.median(r["steps_cpu_busy"] for r in runs),
            "exchange_share": statistics.median(r["exchange_share"] for r in runs),
            "rewards": runs[0]["rewards"], "runs": runs}
    baseline = label("colocated", bounds[0])  # colocated at the smallest K asked for (0 by default)
    by_repeat = {f"pivot{k}_over_colocated{bounds[0]}": repeat_ratios(results, label("pivot", k), baseline)
                 for k in bounds}
    if "disaggregated" in placements:
        by_repeat |= {f"pivot{k}_over_disaggregated{k}": repeat_ratios(results, label("pivot", k),
                                                                        label("disaggregated", k)) for k in bounds}
    ratios = {name: statistics.median(values) for name, values in by_repeat.items()}
    figures = {"nproc": args.nproc, "steps": args.steps, "repeats": args.repeats, "workload": args.workload,
               "max_staleness": bounds, "split": None if "disaggregated" in skipped else args.split,
               "skipped": skipped, "placements": table, "ratios": ratios, "ratios_by_repeat": by_repeat,
               # Colocated leaves the rest of the machine idle; no placement can use more than all of it.
               "bound_over_colocated": 1 / table[baseline]["steps_cpu_busy"], **model, "rounds": rounds}
    report(figures, table, model, cpus, args)
    if args.json:
        result_files.write(args.json, figures, to_json(figures))


def to_json(figures: dict) -> str:
    """The figures indented, and the runs' rounds a line per step rolled out (a step holds thousands of
    numbers: a line each would make the file ten times longer)."""
    text = json.dumps({key: v for key, v in figures.items() if key != "rounds"}, indent=1)
    runs = ",\n".join(f" {json.dumps(name)}: [\n" + ",\n".join(f"  {json.dumps(line, separators=(',', ':'))}"
                                                              for line in lines) + "\n ]"
                      for name, lines in figures["rounds"].items())
    return text[:-2] + ',\n "rounds": {\n' + runs + "\n }\n}\n"


def report(figures: dict, table: dict, model: dict, cpus: int, args) -> None:
    if args.workload == "longtail":
        print(f"\n{LABEL}")
    print(f"\n{'placement':16s} {'samples/s':>10s} {'tokens/s':>10s} {Role.ROLLOUT:>8s} {Role.JUDGE:>8s} {Role.TRAIN:>8s} "
          f"{'shifts/step':>12s} {'exchange':>9s} {'CPU busy: steps':>16s} {'whole run':>10s}")
    for placement, row in table.items():
        b = row["busy"]
        print(f"{placement:16s} {row['samples_per_s']:10.1f} {row['tokens_per_s']:10.1f} {b[Role.ROLLOUT]:8.2f} "
              f"{b[Role.JUDGE]:8.2f} {b[Role.TRAIN]:8.2f} {row['shifts_per_step']:12.1f} {row['exchange_share']:9.1%} "
              f"{row['steps_cpu_busy']:16.0%} {row['cpu_busy']:10.0%}")
    print("(exchange: the share of rollout+judge time spent in the exchange with rank 0, metrics' exchange_s)")
    print()
    for name, value in figures["ratios"].items():
        repeats = ", ".join(f"{r:.2f}" for r in figures["ratios_by_repeat"][name])
        print(f"{name:28s} {value:.2f}x (repeats {repeats})   (this machine's bound over colocated: "
              f"{figures['bound_over_colocated']:.2f}x)")
    print(f"(bound: 1 / colocated's CPU busy fraction during its steps; {cpus} cores, shared with whatever else runs "
          f"on the machine)")
    if model:
        print_cost_model(model, cpus)
    print("\nreward per step (first repeat)")
    print("step " + " ".join(f"{p:>16s}" for p in table))
    for step in range(args.steps):
        print(f"{step:4d} " + " ".join(f"{table[p]['rewards'][step]:16.3f}" for p in table))


def print_cost_model(model: dict, cpus: int) -> None:
    print(f"\ncost model ({cpus} cores; seconds uncontended, i.e. measured / max(1, ranks working / cores))")
    for role in (Role.ROLLOUT, Role.JUDGE):
        print(f"  {role:8s} engine step {model[f'{role}_step_s'] * 1e3:.2f} ms + "
              f"{model[f'{role}_per_seq_s'] * 1e3:.3f} ms/seq over {model[f'{role}_engine_steps']} steps, "
              f"prefill {model[f'{role}_prefill_per_s'] or 0:.0f} tokens/s; by ranks working: " + ", ".join(
                  f"{k}: {v['measured_s'] * 1e3:.1f} ms measured, {v['predicted_s'] * 1e3:.1f} fitted"
                  + (f" (decoding alone {v['decode_measured_s'] * 1e3:.1f}, {v['decode_predicted_s'] * 1e3:.1f})"
                     if "decode_steps" in v else "")
                  for k, v in model[f"{role}_by_busy_ranks"].items()))
    print("  train    " + ", ".join(f"{n} rank(s) {v:.0f}" for n, v in model["train_tokens_per_s_by_ranks"].items())
          + " tokens/s per rank")
    print("  shifts   " + ", ".join(f"{pair} {v:.3f} s" for pair, v in model["shift_s"].items()))
    print("  rounds   exchange " + ", ".join(f"{p} {v * 1e3:.1f}" for p, v in model["exchange_per_round_s"].items())
          + " ms each; planner " + ", ".join(f"{p} {v * 1e3:.2f}" for p, v in model["plan_per_round_s"].items()) + " ms; a whole round "
          + ", ".join(f"{p} {v * 1e3:.1f}" for p, v in model["round_mean_s"].items()) + " ms")


if __name__ == "__main__":
    main()
