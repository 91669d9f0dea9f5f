"""Bad input stops pivot_train.py before any work, with a message that says what to change. Every case
runs as a dry run (or stops before the process group), so a check that failed to fire would not train."""
import json
import shutil
import sys

import pytest

import algorithm
import pivot_train
from conftest import JUDGE, ROOT

DRY = ["--dry-run", "--world-size", 2]


def refused(argv, message):
    with pytest.raises(SystemExit, match=message):
        pivot_train.main([str(a) for a in argv])


def test_missing_model_directory(tmp_path):
    refused([*DRY, "--policy", tmp_path / "absent"], "--policy .*absent: no config.json there; pass a Hugging Face")


def test_unreadable_model_directory(tmp_path):
    judge = shutil.copytree(JUDGE, tmp_path / "judge")
    (judge / "config.json").write_text("{not json")
    refused([*DRY, "--judge-model", judge], "--judge-model .*judge: cannot read it as a Hugging Face model .*not a valid JSON")


def test_a_template_the_judge_tokenizer_cannot_write(tmp_path):
    template = tmp_path / "judge.txt"
    template.write_text("Problem: {prompt}\nresponse: {response}\ngold: {reference}\n")
    refused([*DRY, "--judge-template", template], "--judge-model .*its tokenizer cannot write 'P' of --judge-template")


def test_a_judge_tokenizer_that_cannot_end_a_critique(tmp_path):
    judge = shutil.copytree(JUDGE, tmp_path / "judge")
    config = json.loads((judge / "tokenizer_config.json").read_text())
    (judge / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": None}))
    refused([*DRY, "--judge-model", judge], "no end-of-sequence token")


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
    refused(["--dry-run", "--world-size", 4, "--placement", "disaggregated", "--split", "rollout=1,judge=1,train=1"],
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


def test_a_reward_source_that_needs_a_reference_refuses_data_without_one(tmp_path):
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1=", "reference": "2"}\n{"prompt": "2+2="}\n')
    refused([*DRY, "--data", tmp_path / "data.jsonl", "--eval-split", 0.5, "--reward", "judge=1,exact=1"],
            r'--reward judge=1,exact=1: exact compares each answer with its record\'s "reference", and 1 records')


@pytest.mark.parametrize("flags, message", [
    (["--reward", "judge=1,critic=2"], "'critic' is not a reward source; use judge, exact, format, overlong"),
    (["--reward", "overlong=1"], "has overlong, which needs --overlong-buffer N from 1 to --max-response-tokens"),
    (["--reward", "overlong=1", "--overlong-buffer", 65], r"--max-response-tokens \(64\); got 65"),
])
def test_a_reward_recipe_that_cannot_be_used(flags, message):
    refused([*DRY, *flags], message)


@pytest.mark.parametrize("flags, message", [
    (["--filter-groups", "--max-staleness", 1], "--filter-groups does not work with --max-staleness 1: .* use "
                                                "--max-staleness 0"),
    (["--filter-groups", "--filter-groups-max-prompts", 15], r"--filter-groups-max-prompts must be at least "
                                                             r"--prompts-per-step \(16\): .*; got 15"),
    (["--filter-groups-max-prompts", 64], "--filter-groups-max-prompts applies with --filter-groups only"),
    (["--filter-groups", "--filter-groups-max-prompts", 0], "--filter-groups-max-prompts must be at least 1"),
])
def test_group_filtering_where_it_cannot_work(flags, message):
    refused([*DRY, *flags], message)


def test_wandb_project_without_wandb_installed(monkeypatch):
    # requirements.txt installs wandb; an environment without it is one where importing it fails, which a
    # None in sys.modules is (importlib.util.find_spec then answers None, as for a package not there)
    monkeypatch.setitem(sys.modules, "wandb", None)
    refused([*DRY, "--wandb-project", "pivot"], "--wandb-project pivot: wandb is not installed: pip install wandb")


def test_a_bad_kill_spec(monkeypatch):
    monkeypatch.setenv("PIVOT_KILL", "1:judging:2")
    refused(DRY, "PIVOT_KILL='1:judging:2': expected RANK:POINT:N with POINT one of rollout, judge")


@pytest.mark.parametrize("flags, message", [
    (["--temperature", 0], "--temperature must be above 0: the policy samples at it"),
    (["--temperature", -1], "--temperature must be above 0"),
    (["--lr", 0], r"--lr must be above 0 \(AdamW's learning rate, e.g. 2e-4\); got 0.0"),
    (["--lr", -1], "--lr must be above 0"),
    (["--lr", "nan"], "--lr must be above 0 .*; got nan"),
    (["--weight-decay", -0.1], "--weight-decay must be 0 or more"),
    (["--grad-clip", 0], "--grad-clip must be above 0"),
    (["--grad-clip", "inf"], "--grad-clip must be above 0 .*; got inf"),
    (["--clip-eps", 0], r"--clip-eps must be in \(0, 1\)"),
    (["--clip-eps", 1], r"--clip-eps must be in \(0, 1\)"),
    (["--kl-coef", -0.01], "--kl-coef must be 0 or more"),
    (["--clip-eps-high", 0], "--clip-eps-high must be above 0: the ratio's upper clip"),
    (["--lr-warmup-steps", -1], "--lr-warmup-steps must be 0 or more"),
    (["--max-staleness", -1], "--max-staleness must be 0 or more"),
    (["--rollout-is-threshold", 1], "--rollout-is-threshold must be above 1: the largest importance weight kept"),
    (["--eval-split", 1], r"--eval-split must be in \[0, 1\)"),
    (["--eval-split", -0.1], r"--eval-split must be in \[0, 1\)"),
    (["--eval-prompts", 0], "--eval-prompts must be at least 1"),
    (["--eval-every", 0], "--eval-every must be at least 1"),
    (["--eval-samples", -1], r"--eval-samples must be 0 or more \(answers sampled per held-out prompt for avg@K"),
    (["--max-model-len", 1], "--max-model-len must be at least 2: a prompt token and a response token"),
    (["--max-response-tokens", 0], "--max-response-tokens must be at least 1"),
    (["--max-critique-tokens", 0], "--max-critique-tokens must be at least 1"),
    (["--overlong-buffer", -1], "--overlong-buffer must be 0 or more"),
    (["--prompts-per-step", 0], "--prompts-per-step must be at least 1"),
    (["--force-shift-rate", 1.5], r"--force-shift-rate must be in \[0, 1\]"),
    (["--force-shift-rate", -0.2], r"--force-shift-rate must be in \[0, 1\]"),
    (["--round-steps", 0], "--round-steps must be at least 1"),
    (["--kv-cache-mb", 0], "--kv-cache-mb must be at least 1"),
    (["--max-seqs", 0], "--max-seqs must be at least 1"),
    (["--minibatches", 0], "--minibatches must be at least 1"),
    (["--micro-batch", 0], "--micro-batch must be at least 1"),
    (["--steps", -1], "--steps must be 0 or more"),
    (["--checkpoint-every", -1], "--checkpoint-every must be 0 or more"),
    (["--seed", -1], "--seed must be 0 or more"),
    (["--nproc-per-node", 0], "--nproc-per-node must be at least 1"),
    (["--device-memory-gib", 0], "--device-memory-gib must be above 0"),
    (["--answer-marker", ""], "--answer-marker must not be empty"),
], ids=lambda v: " ".join(map(str, v)) if isinstance(v, list) else None)
def test_numbers_that_make_no_sense(flags, message):
    refused([*DRY, *flags], message)


def test_out_that_is_a_file(tmp_path):
    (tmp_path / "run").write_text("")
    refused([*DRY, "--out", tmp_path / "run"], "--out .*run is a file: pass a directory")


def test_every_numeric_flag_has_a_rule():
    numeric = {a.dest for a in pivot_train.build_parser()._actions if a.type in (int, float)}
    # --force-shifts takes any integer: it only seeds a random schedule
    rules = pivot_train.NUMBER_RULES + algorithm.number_rules()
    assert numeric - {"force_shifts"} == {flag for flag, _, _ in rules}


def test_a_checkpoint_of_step_locked_updates_is_resumed_step_locked_only():
    """A K = 2 run checkpointed before --updates existed holds 2 steps ahead; ready-first holds 1."""
    ready = pivot_train.parse_args(["--max-staleness", "2", "--out", "runs/x"])
    with pytest.raises(SystemExit, match="holds 2 steps rolled out ahead.*resume it with --updates step"):
        pivot_train.check_pending(2, ready)
    pivot_train.check_pending(1, ready)
    pivot_train.check_pending(2, pivot_train.parse_args(["--max-staleness", "2", "--updates", "step", "--out", "x"]))
