"""pivot_train.py --dry-run: a configuration checked for N ranks without torchrun and without weights."""
import argparse

import pytest
import torch
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


def dry_run(argv) -> dict:
    """dryrun.sizing for these flags, with the placement's options as pivot_train.py checks them."""
    args = pivot_train.parse_args([str(a) for a in argv])
    return dryrun.sizing(args, pivot_train.check_placement(args, args.world_size))


def args_for(root, *extra):
    return ["--dry-run", "--policy", root / "moe", "--judge-model", root / "judge", "--data", root / "data.jsonl",
            "--eval-split", "0.1", "--kv-cache-mb", "16384", "--max-model-len", "4096", *map(str, extra)]


def test_sizes_128_ranks_from_configs_alone(config_only, capsys):
    assert not list(config_only.glob("*/*.safetensors"))  # nothing to load: it must not try
    small_steps = ("--micro-batch", 4, "--activation-checkpointing")  # so that the rollout role is the largest
    pivot_train.main([str(a) for a in args_for(config_only, "--world-size", 128, *small_steps)])
    printed = capsys.readouterr().out
    assert not dist.is_initialized()
    assert "128 ranks = 16 nodes x 8" in printed and "rollout: ranks 0-127 (128)" in printed
    assert "Qwen3MoeForCausalLM" in printed and "Qwen3ForCausalLM" in printed
    for line in ("  rollout ", "  judge ", "  train ", "  peak ", "host shared memory per node", "data: 18 training"):
        assert line in printed

    argv = [str(a) for a in args_for(config_only, "--world-size", 128, *small_steps)]
    sizing = dry_run(argv)
    params = sizing["policy"]["params"]
    assert 30e9 < params < 31e9
    assert sizing["device_bytes"]["rollout"]["weights"] == 2 * params  # bf16
    assert sizing["device_bytes"]["rollout"]["kv_cache"] == 16384 << 20
    train = sizing["device_bytes"]["train"]
    # rank 0's FSDP2 rows: a 128th of every parameter, rounded up per tensor
    assert 4 * params / 128 <= train["master_fp32"] < 4 * params / 128 * 1.05
    assert train["grads_fp32"] == train["master_fp32"] and train["adamw_moments_fp32"] == 2 * train["master_fp32"]
    # the judge's engine stays on the device beside the larger of the other two roles
    assert sizing["device_peak_bytes"] == sum(sizing["device_bytes"]["rollout"].values()) + \
        sum(sizing["device_bytes"]["judge"].values()) and sizing["peak_role"] == "rollout"
    # fewer train ranks, bigger shards
    small = dry_run(args_for(config_only, "--world-size", 16))
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



def built_in(world: int, *flags) -> dict:
    return dry_run(["--dry-run", "--world-size", world, *flags])


def test_the_train_group_is_the_placement_s():
    """The built-in policy by hand: embedding 39 x 128 (tied) + final norm 128 = 5,120; each of 4 layers
    q, k, v 3 x (128 x 128 + 128), o 128 x 128, gate, up, down 3 x 128 x 512, two norms 2 x 128 = 262,784;
    1,056,256 in all. FSDP2 gives rank 0 ceil(rows / ranks) rows of each tensor: over 2 ranks exactly
    half of every tensor but the embedding (20 of 39 rows): 528,192; over 4, 264,096."""
    colocated, pivot = built_in(4), built_in(4, "--placement", "pivot")
    split = built_in(4, "--placement", "disaggregated", "--split", "rollout=2,judge=1,train=1")
    assert colocated["policy"]["params"] == 1_056_256
    assert colocated["roles"] == pivot["roles"] == ["rollout"] * 4
    assert colocated["train_ranks"] == pivot["train_ranks"] == 4
    assert colocated["device_bytes"]["train"]["master_fp32"] == 264_096 * 4
    assert split["roles"] == ["rollout", "rollout", "judge", "train"] and split["train_ranks"] == 1
    assert split["device_bytes"]["train"]["master_fp32"] == 1_056_256 * 4
    assert split["device_bytes"]["train"]["adamw_moments_fp32"] == 2 * 1_056_256 * 4
    assert built_in(2, "--placement", "pivot")["device_bytes"]["train"]["grads_fp32"] == 528_192 * 4


def test_a_split_s_train_group_holds_its_share(config_only):
    """128 ranks of which 8 train: each holds a 16th of the training state, not a 128th."""
    split = dry_run(args_for(config_only, "--world-size", 128, "--placement", "disaggregated",
                             "--split", "rollout=96,judge=24,train=8"))
    everyone = dry_run(args_for(config_only, "--world-size", 128))
    ratio = split["device_bytes"]["train"]["master_fp32"] / everyone["device_bytes"]["train"]["master_fp32"]
    assert 15 < ratio <= 16


def test_micro_batch_shape_by_hand():
    shape = lambda mb, budget, length, response: dryrun.micro_batch_shape(argparse.Namespace(  # noqa: E731
        micro_batch=mb, micro_batch_tokens=budget, max_model_len=length, max_response_tokens=response))
    assert shape(8, 0, 1024, 768) == (8192, 6144, 1024)      # 8 samples of 1024, 768 of them scored
    assert shape(8, 3000, 1024, 768) == (3000, 3000, 1024)   # the budget caps the tokens
    assert shape(8, 500, 1024, 768) == (1024, 768, 1024)     # a sample longer than the budget goes alone


def saved_per_layer(model, input_ids, attention_mask) -> list[float]:
    """Bytes per token each decoder layer keeps for backward, measured: every tensor autograd saves
    during the layer's forward that is not a parameter (or a view of one), each storage once."""
    from roles.trainer import decoder_layers
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    current, tally, seen = [None], {}, set()

    def pack(t):
        storage = t.untyped_storage()
        if current[0] is not None and storage.data_ptr() not in params | seen:
            seen.add(storage.data_ptr())
            tally[current[0]] = tally.get(current[0], 0) + storage.nbytes()
        return t
    for i, layer in enumerate(decoder_layers(model)):
        layer.register_forward_pre_hook(lambda *_, i=i: current.__setitem__(0, i))
        layer.register_forward_hook(lambda *_: current.__setitem__(0, None))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return [tally[i] / input_ids.numel() for i in sorted(tally)]


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_per_layer_against_a_measured_forward(arch, dtype, tmp_path):
    from transformers import AutoModelForCausalLM

    from tinymodel import make_config
    torch.manual_seed(0)
    config = make_config(arch, hidden=256, layers=2, intermediate=512, vocab=300, init_std=0.02)
    config.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    ids = torch.randint(2, 300, (3, 96))
    attention = torch.ones(3, 96, dtype=torch.long)
    attention[1, 60:] = 0
    counted = dryrun.layer_activation_bytes(dryrun.model_summary(str(tmp_path), dtype), dtype)
    for measured in saved_per_layer(model, ids, attention):
        assert measured <= counted <= 1.25 * measured


PAPER = ["--dry-run", "--world-size", 128, "--nproc-per-node", 8, "--policy", ROOT / "models/configs/qwen2.5-72b",
         "--judge-model", ROOT / "models/configs/qwen3-30b-a3b", "--max-model-len", 8192, "--kv-cache-mb", 20480,
         "--device-memory-gib", 141, "--micro-batch", 1, "--activation-checkpointing"]


def test_the_paper_s_72b_policy_fits_h200_ranks_at_engine_tp_8():
    """Qwen2.5-72B's and Qwen3-30B-A3B's public configs (models/configs) on 128 H200 ranks: at --engine-tp 1 a
    rollout rank would hold the whole 72B engine (135.43 GiB of bf16 weights and 20 GiB of KV cache) beside the
    judge's (76.87 GiB), and the dry run says to raise --engine-tp; at 8 each rank holds an eighth of each matrix, the K and V projections'
    8 KV heads one each (the judge's 4 copied onto two ranks each), and every role fits."""
    with pytest.raises(SystemExit, match=r"a rollout rank would need 232.30 GiB with the judge's engine beside it \(76.87 GiB\).*raise --engine-tp \(now 1\)"):
        dry_run(PAPER)
    sizing = dry_run(PAPER + ["--engine-tp", 8])
    policy, judge = sizing["policy"], sizing["judge"]
    assert policy["params"] == 72_706_203_648 and sizing["engines"] == 16
    # every matrix and projection bias split eight ways; the norms (two per layer and the final one) on every rank
    norms = (2 * 80 + 1) * 8192
    assert policy["engine_params_per_rank"] == (policy["params"] - norms) // 8 + norms
    assert policy["engine_kv_bytes_per_token"] == policy["kv_bytes_per_token"] // 8 == 2 * 80 * 1 * 128 * 2
    assert judge["engine_kv_bytes_per_token"] == 2 * 48 * 1 * 128 * 2  # 4 KV heads over 8 ranks: one each, copied
    rollout = sizing["device_bytes"]["rollout"]
    assert rollout["weights"] == 2 * policy["engine_params_per_rank"] and rollout["kv_cache"] == 20480 << 20
    assert sizing["device_peak_bytes"] <= 141 << 30
    assert sum(sizing["node_host_bytes"].values()) / (1 << 30) == pytest.approx(1004.85, abs=0.01)


@pytest.mark.parametrize("extra, message", [
    (["--engine-tp", 8, "--world-size", 16, "--nproc-per-node", 4], "does not divide the 4 ranks of a node"),
    (["--engine-tp", 64, "--world-size", 64, "--nproc-per-node", 64], "do not split over --engine-tp 64"),
    (["--engine-tp", 2, "--world-size", 3, "--nproc-per-node", 3], "does not divide the world's 3 ranks"),
    (["--engine-tp", 2, "--world-size", 8, "--placement", "disaggregated", "--split", "rollout=2,judge=1,train=2"],
     "places 5 slot\\(s\\) of --engine-tp 2 ranks but the world has 4"),
])
def test_engine_tp_that_cannot_be_laid_out_says_what_to_change(config_only, extra, message):
    """An engine spans ranks of one node, splits its attention heads evenly, and a split counts slots."""
    with pytest.raises(SystemExit, match=message):
        dry_run(args_for(config_only, *extra))


def test_a_split_counts_slots_of_engine_tp_ranks(config_only):
    split = dry_run(args_for(config_only, "--world-size", 16, "--engine-tp", 4, "--placement", "disaggregated",
                             "--split", "rollout=2,judge=1,train=1"))
    assert split["roles"] == ["rollout"] * 8 + ["judge"] * 4 + ["train"] * 4 and split["train_ranks"] == 4
