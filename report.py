"""What a run shows of itself on rank 0: a console line per step and per evaluation, and at the end
curves.png and a summary. The end reads everything from metrics.jsonl, so after a resume the picture and
the summary cover the whole run, not only its last launch."""
import json
from pathlib import Path

# curves.png: (panel title, y label, [(metric, legend, line style)], whether the values are fractions)
PANELS = [
    ("reward", "mean reward of the step's samples",
     [("reward_mean", "each step", ".-"), ("reward_mean/5", "mean of the last 5 steps", "-")], True),
    ("held-out accuracy", "greedy answers right", [("eval_accuracy", "eval accuracy", "o-")], True),
    ("judge agreement with the reference check", "fraction of samples",
     [("genrm_agreement_train", "step's samples", ".-"), ("genrm_agreement", "held-out answers", "o-")], True),
    ("throughput", "samples per second", [("samples_per_s", "samples/s", ".-")], False),
]


def step_line(record: dict, steps: int) -> str:
    """One training step: its reward, speed and each role's busy seconds (summed over ranks)."""
    busy = " ".join(f"{role} {seconds:.1f}" for role, seconds in record["busy_s"].items())
    parts = [f"step {record['step']}/{steps}", f"reward {record['reward_mean']:.3f}",
             f"{record['samples_per_s']:.1f} samples/s", f"{record['step_time_s']:.1f} s",
             f"busy s: {busy}"]
    if record["genrm_parse_failures"]:
        parts.append(f"judge outputs unparsed {record['genrm_parse_failures']}")
    return " | ".join(parts)


def eval_line(record: dict) -> str:
    """An evaluation of the weights after `step` updates."""
    prompts = sum(record["genrm_confusion"].values())
    return (f"eval at step {record['step']} | accuracy {record['eval_accuracy']:.3f} | judge agreement "
            f"{record['genrm_agreement']:.3f} | {prompts} held-out prompts")


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def series(records: list[dict], metric: str) -> tuple[list[int], list[float]]:
    """(steps, values) of a metric over the run, for the steps that have it; "name/K" is the mean of
    the last K values of "name" at each step."""
    name, _, window = metric.partition("/")
    points = [(r["step"], r[name]) for r in records if r.get(name) is not None]
    steps, values = [s for s, _ in points], [v for _, v in points]
    if window:
        k = int(window)
        values = [sum(values[max(0, i + 1 - k):i + 1]) / min(i + 1, k) for i in range(len(values))]
    return steps, values


def draw_curves(out: Path, records: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for ax, (title, ylabel, lines, fraction) in zip(axes.flat, PANELS):
        for metric, label, style in lines:
            ax.plot(*series(records, metric), style, label=label, markersize=5)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.set_ylim(*((-0.03, 1.03) if fraction else (0, None)))
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if len(lines) > 1:
            ax.legend(loc="lower right", fontsize=9)
    for ax in axes[1]:
        ax.set_xlabel("step (evaluations: the weights after that many steps)")
    fig.suptitle(f"{out}: {len([r for r in records if 'reward_mean' in r])} steps")
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=100)
    plt.close(fig)


def summary(out: Path, records: list[dict]) -> list[str]:
    """The run's last lines: what it did, how fast, what it learned, and where its files are."""
    steps = [r for r in records if "reward_mean" in r]
    samples, seconds = sum(r["samples"] for r in steps), sum(r["step_time_s"] for r in steps)
    lines = [f"done: {len(steps)} steps, {samples} samples in {seconds:.0f} s of steps "
             f"({samples / seconds:.1f} samples/s)" if steps else "done: no training step"]
    evals = [r for r in records if "eval_accuracy" in r]
    if evals:
        first, last = evals[0], evals[-1]
        lines[0] += (f"; eval accuracy {first['eval_accuracy']:.3f} at step {first['step']} -> "
                     f"{last['eval_accuracy']:.3f} at step {last['step']}, judge agreement "
                     f"{last['genrm_agreement']:.3f}")
    files = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir() if not p.name.startswith("."))
    lines.append(f"files in {out}: {' '.join(files)}")
    return lines


def finish(out: Path) -> None:
    """Rank 0, once the run's last record is written: curves.png, then the summary."""
    records = read_metrics(out)
    draw_curves(out, records)
    for line in summary(out, records):
        print(line, flush=True)
