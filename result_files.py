"""Result files: the figures a bench or the simulator measured, with what made them. Every script that
writes `--json PATH` writes it through `result_files.write`, which adds `run`: the command, the commit (with
"+changes" where the tree held uncommitted changes), the date and the machine. The tables the README and
docs/ show are made from such files committed under bench/results/ (`python tables.py`), so each figure
there can be traced to the run that made it and made again."""
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def commit() -> str:
    """The checkout's commit, "+changes" after it where tracked files differ from it; "unknown" outside git."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short=12", "HEAD")
        return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> str:
    """The processor's model, its cores and the accelerator if any, in words."""
    model = platform.processor() or platform.machine()
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        model = names[0] if names else model
    except OSError:
        pass
    gpu = ""
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        gpu = f", {sys.modules['torch'].cuda.get_device_name(0)}"
    return f"{model}, {os.cpu_count()} cores{gpu}"


def command(argv: list[str]) -> str:
    """The command line as typed from the repository's root: `python -m sim ...`, `python bench/x.py ...`."""
    script = Path(argv[0]).resolve()
    if script.name == "__main__.py":
        head = ["python", "-m", script.parent.name]
    else:
        head = ["python", str(script.relative_to(HERE)) if HERE in script.parents else argv[0]]
    return shlex.join(head + list(argv[1:]))


def stamp(argv: list[str] | None = None) -> dict:
    """What made a result: its command (this process's), commit, date (UTC) and machine."""
    return {"command": command(sys.argv if argv is None else argv), "commit": commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine()}


def write(path: str | Path, figures: dict, text: str | None = None) -> None:
    """`figures` to `path` as JSON, the run's `stamp` as its first key `run`; `text`: the figures already
    laid out as a JSON object by the script (the stamp goes in front of its first key)."""
    if text is None:
        text = json.dumps(figures, indent=1)
    run = json.dumps(stamp(), separators=(", ", ": "))
    Path(path).write_text('{\n "run": ' + run + "," + text.lstrip()[1:])


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())
