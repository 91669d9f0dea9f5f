"""A run stopped after a checkpoint and started again with the same command ends exactly where the
uninterrupted run ends: training state bit for bit, and the same metrics."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, torchrun

STEPS = 3
SMALL = ["--prompts-per-step", 4, "--group-size", 4, "--eval-every", 100, "--eval-prompts", 8,
         "--checkpoint-every", 1]
FINAL = f"checkpoints/step-{STEPS:06d}/state.bin"


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "run"
    torchrun(ROOT / "pivot_train.py", "--steps", STEPS, "--out", out, *SMALL)
    return out


def same_run(a, b):
    assert (a / FINAL).read_bytes() == (b / FINAL).read_bytes()
    assert [r["step"] for r in metrics(b)] == list(range(STEPS + 1))
    assert [r.get("reward_mean") for r in metrics(a)] == [r.get("reward_mean") for r in metrics(b)]
    assert metrics(a)[-1]["eval_accuracy"] == metrics(b)[-1]["eval_accuracy"]


def test_stop_and_run_again(whole, tmp_path):
    cut = tmp_path / "cut"
    torchrun(ROOT / "pivot_train.py", "--steps", 1, "--out", cut, *SMALL)
    torchrun(ROOT / "pivot_train.py", "--steps", STEPS, "--out", cut, *SMALL)
    assert (cut / "checkpoints/LATEST").read_text() == f"step-{STEPS:06d}"
    same_run(whole, cut)


def test_resume_with_other_settings_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    proc = subprocess.run([sys.executable, str(ROOT / "pivot_train.py"), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "no checkpoint to resume from" in proc.stderr
