"""The tables that the README and docs/ show, made from the result files committed under bench/results/
(each written by a bench or the simulator with `--json`, which records its command, commit, date and
machine: result_files.py). A table sits in its page between `<!-- table: NAME -->` and `<!-- /table -->`.

    python tables.py            rewrite every table from its result files
    python tables.py --check    list the tables that differ from their files (exit 1 if any)

To change a figure, rerun the command the table names (it writes the file) and run `python tables.py`.
tests/unit/test_tables.py fails where a table was edited by hand.
"""
import argparse
import re
import statistics
import sys
from pathlib import Path

import result_files

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "bench" / "results"
PAGES = [HERE / "README.md", *sorted((HERE / "docs").glob("*.md"))]
MARKED = re.compile(r"(<!-- table: ([\w-]+) -->\n)(.*?)(<!-- /table -->)", re.S)


def source(files: list[dict], names: list[str]) -> str:
    """The line under a table: which file(s) it comes from and the command that made each."""
    made = "; ".join(f"`bench/results/{name}`, from `{f['run']['command']}` on {f['run']['date'][:10]} "
                     f"({f['run']['machine']})" for name, f in zip(names, files))
    return f"\n(Made by `python tables.py` from {made}.)\n"


def row(cells) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def ratio(value: float) -> str:
    return f"{value:.2f}x"


def sim_ratios(k: int) -> list[str]:
    """Pivot's ratios at K, as a `python -m sim` report names them."""
    return [f"pivot{k}_over_colocated0", f"pivot{k}_over_disaggregated{k}", "pivot0_over_colocated0",
            f"pivot{k}_over_bound"]


def over_seeds(group: dict, key: str) -> str:
    """A ratio of a `python -m sim` group: its mean over the seeds, with the lowest and highest seed's
    beside it where there are several."""
    each = [r[key] for r in group["seeds"].values()]
    return ratio(group["mean"][key]) + (f" ({min(each):.2f}-{max(each):.2f})" if len(each) > 1 else "")


def seeds_line(*reports: dict) -> list[str]:
    """What a simulated table's figures are: the seeds, the loop's --updates and the timed updates of each
    run (each preset's, where they differ)."""
    said = {}
    for r in reports:
        said.setdefault((", ".join(map(str, r["seeds"])), r["updates"], r["steps"]), []).append(r["preset"])
    lines = []
    for (seeds, updates, steps), presets in said.items():
        several = ", the lowest and highest seed's in brackets" if len(seeds.split(",")) > 1 else ""
        lines.append(("" if len(said) == 1 else f"{' and '.join(presets)}: ")
                     + f"seeds {seeds}, `--updates {updates}`, {steps} timed updates a run; each figure is the "
                     f"mean over the seeds{several}.")
    return [line[0].upper() + line[1:] for line in lines] + [""]


def simulated(report: dict) -> list[str]:
    """Each group of a `python -m sim` report: step seconds per placement, then pivot's ratios, each the
    mean over the report's seeds."""
    k = report["max_staleness"]
    runs = [("colocated", 0), ("disaggregated", k), ("pivot", 0), ("pivot", k)]
    lines = seeds_line(report) + [
        row(["group", *(f"{p}@{j} step s" for p, j in runs), f"pivot@{k} / colocated@0",
             f"pivot@{k} / disaggregated@{k}", "pivot@0 / colocated@0", f"pivot@{k} / bound"]),
        row(["---"] * 9)]
    for group, g in report["groups"].items():
        seconds = [g["mean"]["step_s"][f"{p}@{j}"] for p, j in runs]
        lines.append(row([group, *(f"{s:.0f}" for s in seconds), *(over_seeds(g, key) for key in sim_ratios(k))]))
    return lines


def simulated_summary(*reports: dict) -> list[str]:
    """Every preset's groups in one table: pivot's four ratios, each the mean over the report's seeds."""
    lines = seeds_line(*reports) + [
        row(["preset: group", "pivot@K / colocated@0", "pivot@K / disaggregated@K", "pivot@0 / colocated@0",
             "pivot@K / bound"]), row(["---"] * 5)]
    for report in reports:
        k = report["max_staleness"]
        for group, g in report["groups"].items():
            name = f"{report['preset']} (K = {k}): {group}"
            lines.append(row([name, *(over_seeds(g, key) for key in sim_ratios(k))]))
    return lines


def measured(bench: dict) -> list[str]:
    """A bench/placements.py report: each placement's throughput, then each ratio's median and repeats."""
    lines = [row(["placement", "samples/s", "shifts per step", "CPU busy in steps"]), row(["---"] * 4)]
    for name, p in bench["placements"].items():
        lines.append(row([name, f"{p['samples_per_s']:.1f}", f"{p['shifts_per_step']:.1f}",
                          f"{p['steps_cpu_busy']:.0%}"]))
    lines += ["", row([f"ratio ({bench['nproc']} ranks, {bench['repeats']} repeats, {bench['steps']} steps each)",
                       "median", "repeats"]), row(["---"] * 3)]
    for name, value in bench["ratios"].items():
        repeats = ", ".join(f"{v:.2f}" for v in bench["ratios_by_repeat"][name])
        label = re.sub(r"([a-z])(\d+)", r"\1@\2", name).replace("_over_", " / ")
        lines.append(row([label, ratio(value), repeats]))
    lines.append(row(["the machine's bound over colocated@0 (all cores busy)", ratio(bench["bound_over_colocated"]),
                      ""]))
    return lines


def convergence(bench: dict) -> list[str]:
    """A bench/convergence.py report: held-out accuracy at each evaluated step, a row per setting (the
    median over its repeats), and each repeat's final accuracy."""
    steps = list(next(iter(bench["runs"].values()))["eval_accuracy"][0])
    lines = [row(["held-out accuracy at step", *steps, "final, by repeat"]), row(["---"] * (len(steps) + 2))]
    for setting, run in bench["runs"].items():
        k, *flags = setting.split(" ", 1)
        label = k.replace("K=", "K = ") + "".join(f", `{f}`" for f in flags)
        medians = [statistics.median(r.get(s, float("nan")) for r in run["eval_accuracy"]) for s in steps]
        finals = ", ".join(f"{r.get(steps[-1], float('nan')):.3f}" for r in run["eval_accuracy"])
        lines.append(row([label, *(f"{m:.3f}" for m in medians), finals]))
    return lines


# Each table: how it is drawn and the result files it is drawn from.
TABLES = {
    "sim-summary": (simulated_summary, ["sim-paper.json", "sim-h200.json"]),
    "sim-paper": (simulated, ["sim-paper.json"]),
    "sim-h200": (simulated, ["sim-h200.json"]),
    "placements-task": (measured, ["placements-task.json"]),
    "placements-longtail": (measured, ["placements-longtail.json"]),
    "convergence": (convergence, ["convergence.json"]),
}


def render(name: str, results: Path = RESULTS) -> str:
    """Table `name` from its result files in `results`, with the line that says where it comes from."""
    if name not in TABLES:
        raise SystemExit(f"<!-- table: {name} -->: no such table; tables.py knows {', '.join(TABLES)}")
    draw, names = TABLES[name]
    missing = [n for n in names if not (results / n).is_file()]
    if missing:
        raise SystemExit(f"table {name}: no {', '.join(missing)} in {results}: run the command the page gives "
                         f"beside the table, with --json {results / missing[0]}")
    files = [result_files.load(results / n) for n in names]
    return "\n".join(draw(*files)) + "\n" + source(files, names)


def refresh(text: str, results: Path = RESULTS) -> str:
    """`text` with every marked table made again from its files."""
    return MARKED.sub(lambda m: m.group(1) + render(m.group(2), results) + m.group(4), text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="only list the tables that differ from their files")
    args = p.parse_args(argv)
    stale = []
    for page in PAGES:
        text = page.read_text()
        new = refresh(text)
        if new != text:
            stale.append(page.relative_to(HERE))
            if not args.check:
                page.write_text(new)
    verb = "differ from their files" if args.check else "rewritten"
    print(f"tables {verb}: {', '.join(map(str, stale))}" if stale else "every table matches its result files")
    if args.check and stale:
        sys.exit(1)


if __name__ == "__main__":
    main()
