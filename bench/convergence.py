"""What --max-staleness costs in convergence on the built-in task: a run of pivot_train.py per setting, one
after another on 2 ranks, each --steps steps from the same seed, and the held-out accuracy of each
evaluation (greedy answers of the held-out prompts, checked against their references).

    python bench/convergence.py [--steps 30] [--placement pivot] [--settings "K=0;K=1;K=2;K=2 --updates step"]
                                [--repeats N] [--json PATH] [--out DIR]

A setting is its label (K=N for --max-staleness N) and any further flags of pivot_train.py after it.
`--repeats N` runs every setting N times, interleaved (each setting once, then again): at the same seed a
K = 0 or step-locked run repeats itself exactly, while a ready-first update's groups depend on when each is
judged, so its curve differs from run to run; every run's accuracy is kept, and the table gives each
step's median over the repeats and each repeat's final accuracy.
"""
import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import result_files  # noqa: E402

SETTINGS = "K=0;K=1;K=2;K=2 --updates step;K=2 --rollout-is token"


def flags(setting: str) -> list[str]:
    """`K=2 --rollout-is token` -> ["--max-staleness", "2", "--rollout-is", "token"]."""
    head, *rest = shlex.split(setting)
    if not head.startswith("K="):
        sys.exit(f"--settings: {setting!r} must begin with K=N (its --max-staleness)")
    return ["--max-staleness", head[2:], *rest]


def run(setting: str, setting_flags: list[str], args, out: Path, repeat: int) -> dict[str, float]:
    """One run of the setting (its pivot_train.py flags `setting_flags`): its held-out accuracy by evaluated
    step."""
    folder = out / f"{setting.replace(' ', '_').replace('=', '')}-{repeat}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "pivot_train.py"), "--steps", str(args.steps), "--placement", args.placement,
           "--seed", str(args.seed), "--out", str(folder), *setting_flags]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{shlex.join(cmd)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {str(r["step"]): r["eval_accuracy"] for r in records if "eval_accuracy" in r}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--placement", choices=["colocated", "disaggregated", "pivot"], default="pivot")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settings", default=SETTINGS, help="settings separated by ';', each K=N and any flags")
    p.add_argument("--repeats", type=int, default=1, help="runs of each setting, interleaved")
    p.add_argument("--json", default=None)
    p.add_argument("--out", default=None, help="keep the runs' directories here (default: a temporary one)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        sys.exit(f"--repeats {args.repeats}: give 1 or more")
    settings = [s.strip() for s in args.settings.split(";") if s.strip()]
    runs = {setting: {"flags": flags(setting), "eval_accuracy": []} for setting in settings}  # before any run
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        for repeat in range(args.repeats):
            for setting in settings:
                accuracy = run(setting, runs[setting]["flags"], args, out, repeat)
                runs[setting]["eval_accuracy"].append(accuracy)
                print(f"{setting:28s} #{repeat}  " + "  ".join(f"{step}: {a:.3f}" for step, a in accuracy.items()),
                      flush=True)
    figures = {"steps": args.steps, "placement": args.placement, "seed": args.seed, "repeats": args.repeats,
               "runs": runs}
    if args.json:
        result_files.write(args.json, figures)


if __name__ == "__main__":
    main()
