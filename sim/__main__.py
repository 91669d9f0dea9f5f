"""Cluster-scale simulation of synchronous GRPO with a GenRM: colocated, disaggregated and pivot placements,
the pivot one driven by planner.py. Every input figure comes from sim/calibration.json, with its source.

    python -m sim --gpus 128 --model-group all [--json PATH] [--sweep PNG]
    python -m sim --calibration cpu --measured placements.json --gpus 4   (bench/placements.py's figures)
"""
import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import planner
from sim.calibration import CalibrationError, CpuModel, GpuModel, cpu_workload, gpu_workload, load, value
from sim.engine import RoundRules, Simulation

PLACEMENTS = ("colocated", "disaggregated", "pivot")
PAPER = {"pivot_over_colocated": (1.81, 2.05), "pivot_over_disaggregated": (1.50, 1.95)}  # arXiv 2610.16866, 128 GPUs
SWEEP_GPUS = (8, 16, 32, 64, 128, 256, 512, 1024)


def simulate(cal: dict, group: str, gpus: int, args, changes: dict | None = None) -> dict:
    """Every placement of `group` on `gpus` devices; `changes`: RoundRules fields that differ from the
    loop's rounds (what-if runs)."""
    rules = RoundRules()
    placements, split = PLACEMENTS, None
    if args.calibration == "cpu":
        measured = json.loads(Path(args.measured).read_text())
        model, workload = CpuModel(cal, measured), cpu_workload(measured)
        rules = replace(rules, steps=int(measured["round_steps"]))  # the runs' --round-steps
        if measured["split"] is None:  # the bench could not place it on its ranks
            placements = tuple(p for p in PLACEMENTS if p != "disaggregated")
        else:  # the split the measured disaggregated runs used
            split = {role: int(n) for role, n in (part.split("=") for part in measured["split"].split(","))}
    else:
        model, workload = GpuModel(cal, group), gpu_workload(cal, args.prompts)
    rules = replace(rules, **(changes or {}))
    if gpus % model.slot_gpus:
        raise SystemExit(f"--gpus {gpus}: {group} places its widest role on {model.slot_gpus} GPUs; "
                         f"pass a multiple of {model.slot_gpus}")
    slots = gpus // model.slot_gpus
    if slots < model.min_train_slots:
        raise SystemExit(f"--gpus {gpus}: {group}'s training state needs {model.min_train_slots * model.slot_gpus} "
                         f"devices; pass at least that many")
    # Pivot trains judged groups early, as pivot_train.py does with one minibatch per step.
    config = planner.PlannerConfig(margin=value(cal, "planner.margin"), dwell=value(cal, "planner.dwell"),
                                   early_train=True, min_train_ranks=model.min_train_slots)
    out = {}
    for placement in placements:
        sim = Simulation(model, workload, slots, placement, seed=args.seed, config=config, split=split, rules=rules)
        r = sim.run(args.steps)
        critical = r.critical_path_s
        out[placement] = {"samples_per_s": r.samples_per_s, "tokens_per_s": r.tokens / r.seconds,
                          "step_s": r.step_seconds, "shifts": r.shifts, "mean_shift_s": r.shift_seconds,
                          "rounds": r.rounds, "busy_fraction": r.busy_fraction, "phases_s": r.phases,
                          "slot_seconds": r.slot_seconds,
                          "split": {k: v * model.slot_gpus for k, v in r.split.items()}}
    pivot = out["pivot"]["samples_per_s"]
    # The same seed draws the same steps for every placement: one critical path.
    return {"gpus": gpus, "placements": out, "critical_path_s": critical,
            "colocated_over_critical_path": sum(out["colocated"]["step_s"]) / critical,
            "pivot_over_critical_path": sum(out["pivot"]["step_s"]) / critical,
            "pivot_over_colocated": pivot / out["colocated"]["samples_per_s"],
            "pivot_over_disaggregated": pivot / out["disaggregated"]["samples_per_s"] if "disaggregated" in out
            else None}


def print_group(group: str, r: dict, paper: bool) -> None:
    print(f"\n{group} on {r['gpus']} devices")
    print(f"  {'placement':<15}{'samples/s':>11}{'tokens/s':>11}{'step s':>9}{'busy':>6}{'shifts':>8}"
          f"{'mean shift s':>14}{'rounds/step':>13}  roles at start (devices)")
    for name, p in r["placements"].items():
        steps = len(p["step_s"])
        print(f"  {name:<15}{p['samples_per_s']:>11.2f}{p['tokens_per_s']:>11.0f}{sum(p['step_s']) / steps:>9.1f}"
              f"{p['busy_fraction']:>6.0%}{p['shifts']:>8}{p['mean_shift_s']:>14.2f}{p['rounds'] / steps:>13.0f}"
              f"  {p['split']}")
    states = list(next(iter(r["placements"].values()))["slot_seconds"])
    print(f"  {'device-seconds':<14}" + "".join(f"{k:>13}" for k in states))
    for name, p in r["placements"].items():
        total = sum(p["slot_seconds"].values())
        print(f"  {name:<14}" + "".join(f"{p['slot_seconds'][k] / total:>13.0%}" for k in states))
    phases = r["placements"]["colocated"]["phases_s"]
    total = sum(phases.values())
    print("  colocated's step: " + ", ".join(f"{k.replace('_', ' ')} {v / total:.0%}" for k, v in phases.items()))
    print(f"  critical path (the slowest sample alone, then the update it waits for, on every device): "
          f"{r['critical_path_s'] / len(r['placements']['pivot']['step_s']):.1f} s/step; colocated takes "
          f"{r['colocated_over_critical_path']:.2f}x that (the most any placement can gain over it), pivot "
          f"{r['pivot_over_critical_path']:.2f}x")
    for key, (lo, hi) in PAPER.items():
        if r[key] is not None:
            print(f"  {key:<26}{r[key]:>6.2f}x" + (f"   paper {lo:.2f}-{hi:.2f}x (128 GPUs)" if paper else ""))


def sweep(cal: dict, groups: list[str], args) -> dict:
    curves = {}
    for group in groups:
        for gpus in SWEEP_GPUS:
            try:
                r = simulate(cal, group, gpus, args)
            except (SystemExit, ValueError) as e:  # too few devices for this group's split or TP
                print(f"  sweep: {group} at {gpus} devices skipped: {e}", file=sys.stderr)
                continue
            curves.setdefault(group, []).append((gpus, r["pivot_over_colocated"], r["pivot_over_disaggregated"]))
            print(f"  sweep {group:<20}{gpus:>6} devices: pivot/colocated {r['pivot_over_colocated']:.2f}x, "
                  f"pivot/disaggregated {r['pivot_over_disaggregated']:.2f}x")
    return curves


def draw(curves: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, col, key in ((axes[0], 1, "pivot_over_colocated"), (axes[1], 2, "pivot_over_disaggregated")):
        for group, rows in curves.items():
            ax.plot([r[0] for r in rows], [r[col] for r in rows], marker="o", label=group)
        ax.axhspan(*PAPER[key], color="grey", alpha=0.2, label="paper, 128 GPUs")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices")
        ax.set_title(key.replace("_", " "))
        ax.axhline(1.0, color="black", lw=0.5)
    axes[0].set_ylabel("throughput ratio")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=128)
    p.add_argument("--model-group", default="all", help="a group of calibration.json, or all")
    p.add_argument("--calibration", choices=["h200", "cpu"], default="h200")
    p.add_argument("--measured", help="with --calibration cpu: bench/placements.py's --json output")
    p.add_argument("--calibration-file", default=None, help="another calibration.json")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step instead of the calibrated figure")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--sweep", metavar="PNG", help="also sweep 8 to 1,024 devices and plot the ratios here")
    args = p.parse_args(argv)
    try:
        cal = load(args.calibration_file) if args.calibration_file else load()
    except CalibrationError as e:
        raise SystemExit(str(e))
    if args.calibration == "cpu":
        if not args.measured:
            raise SystemExit("--calibration cpu needs --measured PATH: the JSON bench/placements.py --json writes")
        groups = ["cpu"]
    else:
        groups = list(cal["groups"]) if args.model_group == "all" else [args.model_group]
        for group in groups:
            if group not in cal["groups"]:
                raise SystemExit(f"--model-group {group}: calibration.json has {', '.join(cal['groups'])} or all")
    results = {}
    for group in groups:
        results[group] = simulate(cal, group, args.gpus, args)
        print_group(group, results[group], paper=args.calibration == "h200")
    report = {"gpus": args.gpus, "calibration": args.calibration, "groups": results,
              "paper": {k: list(v) for k, v in PAPER.items()}}
    if args.sweep:
        report["sweep"] = sweep(cal, groups, args)
        draw(report["sweep"], args.sweep)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
