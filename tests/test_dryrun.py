"""pivot_train.py --dry-run: a configuration checked for N ranks without torchrun and without weights."""
import pytest
import torch.distributed as dist

import dryrun
import pivot_train
from conftest import ROOT


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    """A 30B-shaped MoE policy and an 8B-shaped dense judge: configs and tokenizers, no weight files."""
    from tinymodel import make_model
    root = tmp_path_factory.mktemp("configs")
    make_model(str(root / "moe"), arch="qwen3_moe", hidden=2048, layers=48, intermediate=768, experts=128,
               vocab=151936, config_only=True)
    make_model(str(root / "judge"), arch="qwen3", hidden=4096, layers=36, intermediate=12288, vocab=151936,
               config_only=True, chat_template=True)
    data = root / "data.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+{i}=", "reference": "{2 * i}"}}\n' for i in range(20)))
    return root


def args_for(root, *extra):
    return ["--dry-run", "--policy", root / "moe", "--genrm", root / "judge", "--data", root / "data.jsonl",
            "--eval-split", "0.1", "--kv-cache-mb", "16384", "--max-model-len", "4096", *map(str, extra)]


def test_plans_128_ranks_from_configs_alone(config_only, capsys):
    assert not list(config_only.glob("*/*.safetensors"))  # nothing to load: it must not try
    pivot_train.main([str(a) for a in args_for(config_only, "--world-size", 128)])
    printed = capsys.readouterr().out
    assert not dist.is_initialized()
    assert "128 ranks = 16 nodes x 8" in printed and "rollout: ranks 0-127 (128)" in printed
    assert "Qwen3MoeForCausalLM" in printed and "Qwen3ForCausalLM" in printed
    for line in ("  rollout ", "  genrm ", "  train ", "  peak ", "host shared memory per node", "data: 18 training"):
        assert line in printed

    plan = dryrun.plan(pivot_train.parse_args([str(a) for a in args_for(config_only, "--world-size", 128)]))
    params = plan["policy"]["params"]
    assert 30e9 < params < 31e9
    assert plan["device_bytes"]["rollout"]["weights"] == 2 * params  # bf16
    assert plan["device_bytes"]["rollout"]["kv_cache"] == 16384 << 20
    train = plan["device_bytes"]["train"]
    # rank 0's FSDP2 rows: a 128th of every parameter, rounded up per tensor
    assert 4 * params / 128 <= train["master_fp32"] < 4 * params / 128 * 1.05
    assert train["grads_fp32"] == train["master_fp32"] and train["adamw_moments_fp32"] == 2 * train["master_fp32"]
    assert plan["device_peak_bytes"] == sum(plan["device_bytes"]["rollout"].values())
    # fewer train ranks, bigger shards
    small = dryrun.plan(pivot_train.parse_args([str(a) for a in args_for(config_only, "--world-size", 16)]))
    assert small["device_bytes"]["train"]["master_fp32"] > 7 * train["master_fp32"]


@pytest.mark.parametrize("extra, message", [
    (["--world-size", 100], "pass --world-size 104 or a --nproc-per-node that divides 100"),
    (["--world-size", 128, "--kv-cache-mb", 64], "raise --kv-cache-mb to at least"),
    (["--world-size", 128, "--device-memory-gib", 40], "over --device-memory-gib 40"),
    (["--world-size", 0], "--world-size must be at least 1"),
])
def test_bad_configurations_say_what_to_change(config_only, extra, message):
    with pytest.raises(SystemExit, match=message.replace("+", r"\+")):
        pivot_train.main([str(a) for a in args_for(config_only, *extra)])


def test_world_size_needs_dry_run(config_only):
    argv = [str(a) for a in args_for(config_only, "--world-size", 8) if a != "--dry-run"]
    with pytest.raises(SystemExit, match="go together"):
        pivot_train.main(argv)


def test_small_steps_on_many_ranks_are_noted(config_only, capsys):
    pivot_train.main([str(a) for a in args_for(config_only, "--world-size", 256, "--prompts-per-step", 8,
                                               "--group-size", 4)])
    assert "note: only 32 samples per step" in capsys.readouterr().out


def test_rubric_judge_needs_rubric_in_template_and_data(config_only):
    with pytest.raises(SystemExit, match="has no {rubric}"):
        pivot_train.main([str(a) for a in args_for(config_only, "--world-size", 8, "--judge-kind", "rubric")])
    with pytest.raises(SystemExit, match='records have no "rubric"'):
        pivot_train.main([str(a) for a in args_for(config_only, "--world-size", 8, "--judge-kind", "rubric",
                                                   "--judge-template", ROOT / "tasks/judge_rubric.txt")])

