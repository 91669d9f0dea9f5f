"""Bad input stops pivot_train.py before any work, with a message that says what to change. Every case
runs as a dry run (or stops before the process group), so a check that failed to fire would not train."""
import json
import shutil

import pytest

import pivot_train
from conftest import GENRM, ROOT

DRY = ["--dry-run", "--world-size", 2]


def refused(argv, message):
    with pytest.raises(SystemExit, match=message):
        pivot_train.main([str(a) for a in argv])


def test_missing_model_directory(tmp_path):
    refused([*DRY, "--policy", tmp_path / "absent"], "--policy .*absent: no config.json there; pass a Hugging Face")


def test_unreadable_model_directory(tmp_path):
    judge = shutil.copytree(GENRM, tmp_path / "judge")
    (judge / "config.json").write_text("{not json")
    refused([*DRY, "--genrm", judge], "--genrm .*judge: cannot read it as a Hugging Face model .*not a valid JSON")


def test_a_template_the_judge_tokenizer_cannot_write(tmp_path):
    template = tmp_path / "judge.txt"
    template.write_text("Problem: {prompt}\nresponse: {response}\ngold: {reference}\n")
    refused([*DRY, "--judge-template", template], "--genrm .*its tokenizer cannot write 'P' of --judge-template")


def test_a_judge_tokenizer_that_cannot_end_a_critique(tmp_path):
    judge = shutil.copytree(GENRM, tmp_path / "judge")
    config = json.loads((judge / "tokenizer_config.json").read_text())
    (judge / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": None}))
    refused([*DRY, "--genrm", judge], "no end-of-sequence token")


@pytest.mark.parametrize("text, message", [
    ("", "holds no prompts"),
    ('{"prompt": "1+1="}\n{"prompt": 3}\n', r'data.jsonl:2: needs a non-empty string "prompt"'),
    ('{"prompt": "1+1="}\n\n{"prompt" "2+2="}\n', "data.jsonl:3: not valid JSON"),
])
def test_empty_or_malformed_data_names_the_line(tmp_path, text, message):
    (tmp_path / "data.jsonl").write_text(text)
    refused([*DRY, "--data", tmp_path / "data.jsonl"], message)


def test_group_size_below_two():
    refused([*DRY, "--group-size", 1], "--group-size must be at least 2")


def test_a_split_that_does_not_fit_the_world():
    refused(["--dry-run", "--world-size", 4, "--placement", "disaggregated", "--split", "rollout=1,genrm=1,train=1"],
            r"places 3 rank\(s\) but the world has 4: add 1")


def test_a_resume_whose_data_or_models_differ(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints/step-000001").mkdir(parents=True)
    (out / "checkpoints/step-000001/meta.json").write_text(json.dumps({"steps_done": 1, "planner": None}))
    (out / "checkpoints/LATEST").write_text("step-000001")
    saved = vars(pivot_train.parse_args(["--data", str(ROOT / "tasks/data/rubric_example.jsonl")]))
    (out / "config.json").write_text(json.dumps(saved))
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    refused(["--out", out], "holds a run with other settings, so it cannot resume: --data .*rubric_example.jsonl")


def test_a_bad_kill_spec(monkeypatch):
    monkeypatch.setenv("PIVOT_KILL", "1:judging:2")
    refused(DRY, "PIVOT_KILL='1:judging:2': expected RANK:POINT:N with POINT one of rollout, genrm")
