"""A run stopped after a checkpoint and started again with the same command ends exactly where the
uninterrupted run ends: training state bit for bit, and the same metrics."""
import json
import subprocess
import sys

from conftest import ROOT, torchrun

SMALL = ["--prompts-per-step", 4, "--group-size", 4, "--eval-every", 100, "--eval-prompts", 8,
         "--checkpoint-every", 1]


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_resume_is_exact(tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    torchrun(ROOT / "pivot_train.py", "--steps", 3, "--out", whole, *SMALL)
    torchrun(ROOT / "pivot_train.py", "--steps", 1, "--out", cut, *SMALL)
    torchrun(ROOT / "pivot_train.py", "--steps", 3, "--out", cut, *SMALL)
    state = "checkpoints/step-000003/state.bin"
    assert (whole / state).read_bytes() == (cut / state).read_bytes()
    assert (cut / "checkpoints/LATEST").read_text() == "step-000003"
    a, b = metrics(whole), metrics(cut)
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    assert [r.get("reward_mean") for r in a] == [r.get("reward_mean") for r in b]
    assert a[-1]["eval_accuracy"] == b[-1]["eval_accuracy"]


def test_resume_with_other_settings_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    proc = subprocess.run([sys.executable, str(ROOT / "pivot_train.py"), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "no checkpoint to resume from" in proc.stderr
