"""Cluster-scale simulation of GRPO rewarded by a judge (a generative reward model, GenRM)
in colocated, disaggregated and pivot placements, the pivot one driven by planner.py, each at
pivot_train.py's --max-staleness K (pipeline.py). Every input figure comes from sim/calibration.json,
with its source.

    python -m sim --gpus 128 --model-group all [--max-staleness K] [--updates ready|step] [--seeds 0,1,2]
                  [--json PATH] [--sweep PNG]
    python -m sim --preset paper [--model-group G] [--json PATH]   (the paper's 128 H20 and its four groups)
    python -m sim --calibration cpu --measured placements.json --gpus 4   (bench/placements.py's figures)
    python -m sim ... --timeline DIR   (each run's timeline.jsonl and pictures, as pivot_train.py's)
    python -m sim ... --jobs N   (N runs at once, a process each: a group at a seed is a run)

At K = 0 every placement runs synchronous steps. At K > 0 they run as the paper's release launches them
(examples/deployment_modes/mode2_colocated.sh, mode1_disaggregated.sh, mode5_elastic_rl.sh in
victor-yfzhao/psrl): colocated at 0 (its ranks do every phase in turn, so nothing would overlap),
disaggregated and pivot at K, and pivot at 0 beside them, under pivot_train.py's --updates (ready-first
by default: sim.engine.RoundRules.updates); the runs at every K are timed over updates that roll out the
same steps. With several --seeds each group runs at each seed, and the figures' mean over the seeds is
kept beside each seed's. Disaggregated's split is sized to each role's share of the work, or with
`--split search` is the best fixed split a search over splits finds (sim/split.py); `--preset paper`
runs K = 2 and searches.
"""
import argparse
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path

import pipeline
import planner
import result_files
from report import draw_timeline
from sim.calibration import (CalibrationError, CpuModel, FittedGpuModel, GpuModel, cpu_workload, gpu_workload,
                             load, preset, value)
from sim.engine import RoundRules, Simulation
from sim.split import best_split, node_unit

# arXiv 2610.16866, 128 H20: PivotRL over colocated (at K = 0) and over disaggregated (both at K = 2, as
# the release's launchers run them)
PAPER = {"over_colocated": (1.81, 2.05), "over_disaggregated": (1.50, 1.95)}
SWEEP_GPUS = (8, 16, 32, 64, 128, 256, 512, 1024)


def runs(k: int) -> list[tuple[str, int]]:
    """The (placement, K) each group runs."""
    if k == 0:
        return [("colocated", 0), ("disaggregated", 0), ("pivot", 0)]
    return [("colocated", 0), ("disaggregated", k), ("pivot", 0), ("pivot", k)]


def label(placement: str, k: int) -> str:
    return f"{placement}@{k}"


def simulate(cal: dict, group: str, gpus: int, args, changes: dict | None = None, seed: int = 0) -> dict:
    """Every placement of `group` on `gpus` devices at its K (`runs`), under --updates `args.updates`, with
    lengths drawn from `seed`; `changes`: RoundRules fields that differ from the loop's rounds (what-if
    runs)."""
    rules = RoundRules(updates=args.updates)
    k = args.max_staleness
    placements, split = runs(k), None
    if args.calibration == "cpu":
        measured = json.loads(Path(args.measured).read_text())
        model, workload = CpuModel(cal, measured), cpu_workload(measured)
        rules = replace(rules, round_steps=int(measured["round_steps"]))  # the runs' --round-steps
        if measured["split"] is None:  # the bench could not place it on its ranks
            placements = [(p, s) for p, s in placements if p != "disaggregated"]
        else:  # the split the measured disaggregated runs used
            split = {role: int(n) for role, n in (part.split("=") for part in measured["split"].split(","))}
    elif args.preset == "paper":
        model, workload = FittedGpuModel(cal, group), gpu_workload(cal, args.prompts)
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
    largest = max(s for _, s in placements)

    def run(placement: str, staleness: int, fixed: dict | None = None):
        sim = Simulation(model, workload, slots, placement, seed=seed, config=config, split=fixed,
                         rules=rules, max_staleness=staleness)
        sim.spans = [] if args.timeline else None
        # At K > 0 every run skips one more update, so that the first timed step begins with what the
        # step before began (Simulation.run); K = 0 alone begins nothing ahead
        return sim.run(args.steps, skip=largest - sim.pipe + (1 if largest else 0))

    out, searched = {}, None
    for placement, staleness in placements:
        if placement == "disaggregated" and args.search_split and split is None:
            results = {}

            def seconds(candidate: dict) -> float:
                results[tuple(candidate.values())] = run(placement, staleness, candidate)
                return results[tuple(candidate.values())].seconds

            unit = node_unit(slots, int(model.gpus_per_node) // model.slot_gpus, model.min_train_slots)
            chosen, searched = best_split(slots, model.min_train_slots, seconds, unit)
            r = results[tuple(chosen.values())]
        else:
            r = run(placement, staleness, split)
        if args.timeline:
            write_timeline(Path(args.timeline) / group / label(placement, staleness), r.spans, slots)
        out[label(placement, staleness)] = {
            "placement": placement, "max_staleness": staleness, "samples_per_s": r.samples_per_s,
            "trained_samples_per_s": r.trained_samples_per_s,
            "tokens_per_s": r.tokens / r.seconds, "step_s": r.step_seconds, "shifts": r.shifts,
            "mean_shift_s": r.shift_seconds, "rounds": r.rounds, "busy_fraction": r.busy_fraction,
            "phases_s": r.phases, "slot_seconds": r.slot_seconds, "bound_s": r.bound_s,
            "work_bound_s": r.work_bound_s, "over_bound": r.seconds / r.bound_s,
            "split": {key: n * model.slot_gpus for key, n in r.split.items()}}
        critical = r.critical_path_s  # the runs' timed updates roll out the same steps: one critical path
    rate = lambda name: out[name]["samples_per_s"] if name in out else None  # noqa: E731
    pivot = rate(label("pivot", k))
    report = {"gpus": gpus, "max_staleness": k, "updates": rules.updates, "seed": seed, "placements": out,
              "critical_path_s": critical,
              "colocated0_over_critical_path": sum(out["colocated@0"]["step_s"]) / critical,
              f"pivot{k}_over_colocated0": pivot / rate("colocated@0"),
              f"pivot{k}_over_disaggregated{k}": pivot / rate(label("disaggregated", k))
              if label("disaggregated", k) in out else None,
              "pivot0_over_colocated0": rate("pivot@0") / rate("colocated@0"),
              f"pivot{k}_over_bound": out[label("pivot", k)]["over_bound"]}
    if label("disaggregated", k) in out:
        report[f"disaggregated{k}_split"] = out[label("disaggregated", k)]["split"]
    if searched is not None:
        report["splits_simulated"] = searched
    return report


def simulate_run(cal: dict, gpus: int, run: tuple) -> dict:
    """`simulate` of one run, (group, seed, args): a module's function, which a process pool can send."""
    group, seed, args = run
    return simulate(cal, group, gpus, args, seed=seed)


def simulate_all(cal: dict, groups: list[str], seeds: list[int], args):
    """Each group's report by seed (`simulate`), printed group by group in order as each is known. Every run
    draws from its own seed alone, so `args.jobs` processes side by side give the figures one gives."""
    def seed_args(seed: int):
        if args.timeline and len(seeds) > 1:  # each seed's timelines apart
            return argparse.Namespace(**{**vars(args), "timeline": str(Path(args.timeline) / f"seed{seed}")})
        return args

    runs = [(group, seed, seed_args(seed)) for group in groups for seed in seeds]
    with ProcessPoolExecutor(args.jobs) if args.jobs > 1 else nullcontext() as pool:
        reports = (pool.map if pool else map)(partial(simulate_run, cal, args.gpus), runs)  # in the runs' order
        out = {group: {} for group in groups}
        for (group, seed, _), report in zip(runs, reports):
            out[group][str(seed)] = report
            print_group(group, report, paper=args.calibration == "h200")
    return [out[group] for group in groups]


def write_timeline(folder: Path, spans: list[dict], slots: int) -> None:
    """A simulated run's timeline.jsonl and its pictures, as a run of pivot_train.py leaves them (each
    slot a rank)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "timeline.jsonl").write_text("".join(json.dumps(span) + "\n" for span in spans))
    draw_timeline(folder, spans, slots)


def print_group(group: str, r: dict, paper: bool) -> None:
    k = r["max_staleness"]
    print(f"\n{group} on {r['gpus']} devices, seed {r['seed']}, --updates {r['updates']}")
    print(f"  {'placement@K':<17}{'samples/s':>10}{'trained/s':>10}{'tokens/s':>10}{'step s':>8}{'bound s':>9}"
          f"{'/bound':>7}{'busy':>6}{'shifts':>8}{'mean shift s':>13}{'rounds/step':>12}  roles at start (devices)")
    for name, p in r["placements"].items():
        steps = len(p["step_s"])
        print(f"  {name:<17}{p['samples_per_s']:>10.2f}{p['trained_samples_per_s']:>10.2f}{p['tokens_per_s']:>10.0f}"
              f"{sum(p['step_s']) / steps:>8.1f}{p['bound_s'] / steps:>9.1f}{p['over_bound']:>7.2f}"
              f"{p['busy_fraction']:>6.0%}{p['shifts']:>8}{p['mean_shift_s']:>13.2f}{p['rounds'] / steps:>12.0f}"
              f"  {p['split']}")
    states = list(next(iter(r["placements"].values()))["slot_seconds"])
    print(f"  {'device-seconds':<17}" + "".join(f"{s:>13}" for s in states))
    for name, p in r["placements"].items():
        total = sum(p["slot_seconds"].values())
        print(f"  {name:<17}" + "".join(f"{p['slot_seconds'][s] / total:>13.0%}" for s in states))
    phases = r["placements"]["colocated@0"]["phases_s"]
    total = sum(phases.values())
    print("  colocated's step: " + ", ".join(f"{key.replace('_', ' ')} {v / total:.0%}" for key, v in phases.items()))
    steps = len(r["placements"]["colocated@0"]["step_s"])
    print(f"  critical path (the slowest sample alone, then the update it waits for, on every device): "
          f"{r['critical_path_s'] / steps:.1f} s/step; colocated@0 takes {r['colocated0_over_critical_path']:.2f}x "
          f"that. A bound at K (Simulation.run): the step's work at the best rate per device, or the "
          f"critical path spread over K + 1 steps, whichever is longer")
    if "splits_simulated" in r:
        print(f"  disaggregated@{k}'s split: the best of {r['splits_simulated']} simulated (sim/split.py): "
              f"{r[f'disaggregated{k}_split']}")
    ranges = {f"pivot{k}_over_colocated0": PAPER["over_colocated"],
              f"pivot{k}_over_disaggregated{k}": PAPER["over_disaggregated"]}
    for key in dict.fromkeys([f"pivot{k}_over_colocated0", f"pivot{k}_over_disaggregated{k}",
                              "pivot0_over_colocated0", f"pivot{k}_over_bound"]):
        if r[key] is not None:
            lo, hi = ranges.get(key, (None, None))
            print(f"  {key:<28}{r[key]:>6.2f}x" + (f"   paper {lo:.2f}-{hi:.2f}x" if paper and lo else ""))


def ratios(k: int) -> list[str]:
    """Pivot's ratios at K, as a group's report names them."""
    return [f"pivot{k}_over_colocated0", f"pivot{k}_over_disaggregated{k}", "pivot0_over_colocated0",
            f"pivot{k}_over_bound"]


def seed_mean(reports: list[dict]) -> dict:
    """A group's figures over its seeds' `reports`: the mean of each of pivot's ratios (None where a run
    is missing, as disaggregated is where it cannot be placed) and of each placement's seconds per step."""
    k = reports[0]["max_staleness"]
    mean = {key: statistics.mean(r[key] for r in reports) if reports[0][key] is not None else None
            for key in ratios(k)}
    mean["step_s"] = {name: statistics.mean(statistics.mean(r["placements"][name]["step_s"]) for r in reports)
                      for name in reports[0]["placements"]}
    return mean


def print_summary(results: dict, k: int, updates: str, paper: bool) -> None:
    """A line per group: pivot's ratios, their mean over the seeds with each seed's lowest and highest
    beside it where there are several, then disaggregated's split (the first seed's); at the paper preset
    the paper's ranges head the table (arXiv 2610.16866, 128 H20)."""
    (clo, chi), (dlo, dhi) = PAPER["over_colocated"], PAPER["over_disaggregated"]
    seeds = list(next(iter(results.values()))["seeds"])
    print(f"\n--updates {updates}, seed{'s' if len(seeds) > 1 else ''} {', '.join(seeds)}"
          + (": the mean over the seeds (the lowest-highest seed)" if len(seeds) > 1 else "")
          + (f"; paper: pivot@{k}/colocated@0 {clo:.2f}-{chi:.2f}x, pivot@{k}/disaggregated@{k} {dlo:.2f}-{dhi:.2f}x"
             if paper else ""))
    names = [f"pivot@{k}/colocated@0", f"pivot@{k}/disaggregated@{k}", "pivot@0/colocated@0", f"pivot@{k}/bound"]
    print(f"{'group':<30}" + "".join(name.rjust(26) for name in names) + f"  disaggregated@{k} split (GPUs)")
    for group, g in results.items():
        cells = []
        for key in ratios(k):
            if g["mean"][key] is None:
                cells.append("-".rjust(26))
                continue
            each = [r[key] for r in g["seeds"].values()]
            spread = f" ({min(each):.2f}-{max(each):.2f})" if len(each) > 1 else ""
            cells.append(f"{g['mean'][key]:.2f}x{spread}".rjust(26))
        split = next(iter(g["seeds"].values())).get(f"disaggregated{k}_split", {})
        print(f"{group:<30}" + "".join(cells) + "  " + ", ".join(f"{role} {n}" for role, n in split.items()))


def sweep(cal: dict, groups: list[str], args, seed: int) -> dict:
    k, curves = args.max_staleness, {}
    args = argparse.Namespace(**{**vars(args), "timeline": None})  # the pictures are of --gpus alone
    for group in groups:
        for gpus in SWEEP_GPUS:
            try:
                r = simulate(cal, group, gpus, args, seed=seed)
            except (SystemExit, ValueError) as e:  # too few devices for this group's split or TP
                print(f"  sweep: {group} at {gpus} devices skipped: {e}", file=sys.stderr)
                continue
            ratios = r[f"pivot{k}_over_colocated0"], r[f"pivot{k}_over_disaggregated{k}"]
            curves.setdefault(group, []).append((gpus, *ratios))
            print(f"  sweep {group:<20}{gpus:>6} devices: pivot@{k}/colocated@0 {ratios[0]:.2f}x, "
                  f"pivot@{k}/disaggregated@{k} {ratios[1]:.2f}x")
    return curves


def draw(curves: dict, path: str, k: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, col, key, title in ((axes[0], 1, "over_colocated", f"pivot@{k} / colocated@0"),
                                (axes[1], 2, "over_disaggregated", f"pivot@{k} / disaggregated@{k}")):
        for group, rows in curves.items():
            ax.plot([r[0] for r in rows], [r[col] for r in rows], marker="o", label=group)
        ax.axhspan(*PAPER[key], color="grey", alpha=0.2, label="paper, 128 H20")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices")
        ax.set_title(title)
        ax.axhline(1.0, color="black", lw=0.5)
    axes[0].set_ylabel("throughput ratio")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=["h200", "paper"], default="h200",
                   help="h200: H200s and the DAPO workload; paper: the paper's 128 H20, its four groups, K = 2")
    p.add_argument("--gpus", type=int, default=128)
    p.add_argument("--model-group", default="all", help="a group of the preset's, or all")
    p.add_argument("--max-staleness", type=int, default=None, metavar="K",
                   help="pivot_train.py's --max-staleness for disaggregated and pivot (default 0; paper: 2)")
    p.add_argument("--split", choices=["share", "search"], default=None,
                   help="disaggregated's split: sized to each role's share of the work, or the best a search "
                        "over splits finds (default share; paper: search)")
    p.add_argument("--calibration", choices=["h200", "cpu"], default="h200",
                   help="h200: the preset's public figures; cpu: this code on this machine (--measured)")
    p.add_argument("--measured", help="with --calibration cpu: bench/placements.py's --json output")
    p.add_argument("--calibration-file", default=None, help="another calibration.json")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step instead of the calibrated figure")
    p.add_argument("--steps", type=int, default=2, help="timed updates per run")
    p.add_argument("--updates", choices=pipeline.UPDATES, default="ready",
                   help="pivot_train.py's --updates at K >= 2: ready (ready-first, a bound per group) or step "
                        "(step-locked; pipeline.py)")
    p.add_argument("--seeds", "--seed", default="0", metavar="0,1,2",
                   help="the seeds of the lengths drawn, comma-separated: each group runs at each, and the JSON "
                        "keeps each seed's figures and their mean")
    p.add_argument("--jobs", type=int, default=1, help="simulate this many (group, seed) runs at once, each in a "
                   "process of its own (the figures do not change)")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--timeline", metavar="DIR", help="write each run's timeline.jsonl, timeline.png and "
                   "timeline_step.png (a slot per rank, as a run of pivot_train.py draws them) under DIR/GROUP/PLACEMENT@K")
    p.add_argument("--sweep", metavar="PNG", help="also sweep 8 to 1,024 devices and plot the ratios here")
    args = p.parse_args(argv)
    paper = args.preset == "paper"
    if paper and args.calibration == "cpu":
        raise SystemExit("--preset paper is the paper's H20 figures; --calibration cpu replays this machine's")
    args.max_staleness = (2 if paper else 0) if args.max_staleness is None else args.max_staleness
    args.search_split = (args.split or ("search" if paper else "share")) == "search"
    if args.max_staleness < 0:
        raise SystemExit(f"--max-staleness {args.max_staleness}: 0 or more")
    try:
        seeds = [int(seed) for seed in args.seeds.split(",")]
    except ValueError:
        raise SystemExit(f"--seeds {args.seeds}: whole numbers, comma-separated (0,1,2)")
    try:
        cal = preset(load(args.calibration_file) if args.calibration_file else load(), args.preset)
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
                raise SystemExit(f"--model-group {group}: the {args.preset} preset has {', '.join(cal['groups'])} "
                                 f"or all")
    if args.jobs < 1:
        raise SystemExit(f"--jobs {args.jobs}: 1 or more")
    results = {}
    for group, by_seed in zip(groups, simulate_all(cal, groups, seeds, args)):
        results[group] = {"mean": seed_mean(list(by_seed.values())), "seeds": by_seed}
    print_summary(results, args.max_staleness, args.updates, paper)
    report = {"gpus": args.gpus, "preset": args.preset, "calibration": args.calibration,
              "max_staleness": args.max_staleness, "updates": args.updates, "seeds": seeds, "steps": args.steps,
              "groups": results,
              "paper": {key: list(v) for key, v in PAPER.items()}}
    if args.sweep:
        report["sweep"] = sweep(cal, groups, args, seeds[0])
        draw(report["sweep"], args.sweep, args.max_staleness)
    if args.json:
        result_files.write(args.json, report)


if __name__ == "__main__":
    main()
