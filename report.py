"""What a run shows of itself on rank 0: a console line per step and per evaluation, and at the end
curves.png and a summary. The end reads everything from metrics.jsonl, so after a resume the picture and
the summary cover the whole run, not only its last launch."""
import json
from collections import Counter
from pathlib import Path

from roles import PHASES, WAIT, Role

# curves.png: (panel title, y label, [(metric, legend, line style)], whether the values are fractions)
PANELS = [
    ("reward", "mean reward of the step's samples",
     [("reward_mean", "each step", ".-"), ("reward_mean/5", "mean of the last 5 steps", "-")], True),
    ("held-out accuracy", "greedy answers right", [("eval_accuracy", "greedy", "o-")], True),
    ("judge agreement with the reference check", "fraction of samples",
     [("judge_agreement_train", "step's samples", ".-"), ("judge_agreement", "held-out answers", "o-")], True),
    ("throughput", "samples per second", [("samples_per_s", "samples/s", ".-")], False),
]


def clock(seconds: float) -> str:
    """A duration as the console shows it: 42s, 3m07s, 2h05m."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def step_line(record: dict, steps: int, elapsed_s: float, eta_s: float) -> str:
    """One training step: its reward (and with --filter-groups the groups it trained of those it drew),
    speed, each role's busy seconds (summed over ranks), and the run's elapsed time and the time it
    expects to take still."""
    busy = " ".join(f"{role} {seconds:.1f}" for role, seconds in record["busy_s"].items())
    reward = f"reward {record['reward_mean']:.3f}"
    sources = record.get("reward_sources", {})
    if len(sources) > 1:  # more than the judge alone (--reward): each source's mean score
        reward += " (" + " ".join(f"{name} {score:.3f}" for name, score in sources.items()) + ")"
    parts = [f"step {record['step']}/{steps}", reward,
             f"{record['samples_per_s']:.1f} samples/s", f"{record['step_time_s']:.1f} s",
             f"busy s: {busy}", f"elapsed {clock(elapsed_s)} eta {clock(eta_s)}"]
    if "filter_groups" in record:  # --filter-groups: the groups trained of those drawn
        kept = record["filter_groups"]
        parts.insert(2, f"groups trained {kept['trained']}/{kept['prompts_drawn']}"
                        + (", at --filter-groups-max-prompts" if kept["capped"] else ""))
    if record["judge_parse_failures"]:
        parts.append(f"judge outputs unparsed {record['judge_parse_failures']}")
    return " | ".join(parts)


def eval_line(record: dict) -> str:
    """An evaluation of the weights after `step` updates: greedy accuracy, avg@k with --eval-samples k."""
    prompts = sum(record["judge_confusion"].values())
    sampled = "".join(f" | {key.removeprefix('eval_accuracy_')} {record[key]:.3f}" for key in avg_keys([record]))
    return (f"eval at step {record['step']} | accuracy {record['eval_accuracy']:.3f}{sampled} | judge agreement "
            f"{record['judge_agreement']:.3f} | {prompts} held-out prompts")


def avg_keys(records: list[dict]) -> list[str]:
    """The avg@k metrics of the records (--eval-samples k: `eval_accuracy_avg@k`), in the order first seen."""
    return list(dict.fromkeys(key for r in records for key in r if key.startswith("eval_accuracy_avg@")))


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def series(records: list[dict], metric: str) -> tuple[list[int], list[float]]:
    """(steps, values) of a metric over the run, for the steps that have it; "name/K" is the mean of
    the last K values of "name" at each step; "a.b" is b of the record's a."""
    name, _, window = metric.partition("/")
    points = [(r["step"], v) for r in records if (v := lookup(r, name)) is not None]
    steps, values = [s for s, _ in points], [v for _, v in points]
    if window:
        k = int(window)
        values = [sum(values[max(0, i + 1 - k):i + 1]) / min(i + 1, k) for i in range(len(values))]
    return steps, values


def lookup(record: dict, name: str):
    for key in name.split("."):
        record = record.get(key) if isinstance(record, dict) else None
    return record


def source_lines(records: list[dict]) -> list[tuple[str, str, str]]:
    """The reward panel's line per reward source, when --reward has more than the judge."""
    sources = next((r["reward_sources"] for r in records if "reward_sources" in r), {})
    return [(f"reward_sources.{name}", f"{name} (score)", "--") for name in sources] if len(sources) > 1 else []


def avg_lines(records: list[dict]) -> list[tuple[str, str, str]]:
    """The held-out panel's line per avg@k, beside the greedy accuracy."""
    return [(key, f"{key.removeprefix('eval_accuracy_')} (sampled answers)", "s--") for key in avg_keys(records)]


def draw_curves(out: Path, records: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for index, (ax, (title, ylabel, lines, fraction)) in enumerate(zip(axes.flat, PANELS)):
        lines = lines + (source_lines(records) if index == 0 else avg_lines(records) if index == 1 else [])
        for metric, label, style in lines:
            ax.plot(*series(records, metric), style, label=label, markersize=5)
        ax.set_title(title)
        # beside avg@k the panel's answers are not all greedy ones
        ax.set_ylabel("answers right" if index == 1 and len(lines) > 1 else ylabel)
        # a reward of several sources may leave [0, 1] (an overlong penalty, coefficients summing past 1)
        values = [0.0, 1.0] + [v for metric, _, _ in lines for v in series(records, metric)[1]]
        ax.set_ylim(*((min(values) - 0.03, max(values) + 0.03) if fraction else (0, None)))
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
                     f"{last['eval_accuracy']:.3f} at step {last['step']}, "
                     + "".join(f"{key.removeprefix('eval_accuracy_')} {first[key]:.3f} -> {last[key]:.3f}, "
                               for key in avg_keys([first, last]) if key in first and key in last)
                     + f"judge agreement {last['judge_agreement']:.3f}")
    files = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir() if not p.name.startswith("."))
    lines.append(f"files in {out}: {' '.join(files)}")
    return lines


def finish(out: Path) -> None:
    """Rank 0, once the run's last record is written: curves.png, then the summary."""
    records = read_metrics(out)
    draw_curves(out, records)
    for line in summary(out, records):
        print(line, flush=True)


# Each kind of span's colour and hatch, and where its legend entry is not its name; a phase's bar goes
# under the shifts made in it.
STYLES = {Role.ROLLOUT: ("tab:blue", None), Role.JUDGE: ("tab:orange", None), Role.TRAIN: ("tab:green", None),
          "shift": ("black", "//"), WAIT: ("lightgrey", None), "startup": ("silver", ".."), "eval": ("plum", "xx"),
          "checkpoint": ("peru", "\\\\"), "export": ("khaki", "++")}
LEGEND = {WAIT: "waiting for the other ranks", "startup": "start-up", "eval": "evaluation"}
ALWAYS = (Role.ROLLOUT, Role.JUDGE, Role.TRAIN, "shift")  # in the legend whether drawn or not


def draw_timeline(out: Path, spans: list[dict], ranks: int) -> None:
    """timeline.png, the whole run; timeline_step.png, the step `step_to_draw` picks, each shift
    labelled with the roles it went between. `spans`: {step, rank, role, start, end} (a shift's role
    "shift", with its "from" and "to"; WAIT; one of PHASES), a run's timeline.jsonl or a simulated
    run's (python -m sim --timeline)."""
    _draw_spans(out / "timeline.png", spans, ranks, "the run", since="the run", origin=0.0)
    picked = step_to_draw(spans)
    if picked:
        step, shifts = picked
        shown = [s for s in spans if s["step"] == step]
        _draw_spans(out / "timeline_step.png", shown, ranks, f"step {step}: {shifts} shifts "
                    f"(r rollout, j judge, t train)", since=f"step {step}", origin=min(s["start"] for s in shown),
                    label_shifts=True)


def step_to_draw(spans: list[dict]) -> tuple[int, int] | None:
    """The step for timeline_step.png and its shifts: of the steps after the first (which starts the
    engines) and, where there are any, with no phase in them (an evaluation, a checkpoint), the latest
    with the most role changes (a run with none: the most reloads); None for a run with no shift."""
    moves = [s for s in spans if s["role"] == "shift"]
    shifts = Counter(s["step"] for s in moves if s["from"] != s["to"]) or Counter(s["step"] for s in moves)
    phased = {s["step"] for s in spans if s["role"] in PHASES}
    later = [k for k in shifts if k > 0] or list(shifts)
    plain = [k for k in later if k not in phased] or later
    if not plain:
        return None
    step = max(plain, key=lambda k: (shifts[k], k))
    return step, shifts[step]


def _draw_spans(path: Path, spans: list[dict], ranks: int, title: str, *, since: str, origin: float,
                label_shifts: bool = False) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    bars = {}  # (rank, role): its spans, drawn in one call (a simulated run has tens of thousands)
    for s in spans:
        bars.setdefault((s["rank"], s["role"]), []).append((s["start"] - origin, s["end"] - s["start"]))
    shown = [kind for kind in STYLES if kind in ALWAYS or any(role == kind for _, role in bars)]
    # tall enough for the legend beside the bars, which has a line per kind of span drawn
    fig, ax = plt.subplots(figsize=(12, min(max(1 + 0.5 * ranks, 0.8 + 0.25 * len(shown)), 16)))
    for s in spans:
        if s["role"] == "shift" and label_shifts and ranks <= 32:
            ax.annotate(f"{s['from'][0]}>{s['to'][0]}", (s["start"] - origin, s["rank"] + 0.42),
                        fontsize=7, ha="left", va="bottom")
    for (rank, role), extents in bars.items():
        colour, hatch = STYLES[role]
        ax.broken_barh(extents, (rank - 0.4, 0.8), facecolors=colour, hatch=hatch, zorder=1 if role in PHASES else 2)
    ax.set_title(title)
    ax.set_xlabel(f"seconds since the start of {since}")
    ax.set_ylabel("rank")
    ax.set_yticks(range(0, ranks, max(1, ranks // 16)))
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, facecolor=STYLES[k][0], hatch=STYLES[k][1]) for k in shown],
              labels=[LEGEND.get(k, str(k)) for k in shown], loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
