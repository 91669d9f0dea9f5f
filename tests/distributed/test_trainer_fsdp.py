"""The FSDP2 trainer on two gloo ranks against plain single-process computations."""
import json

import torch

from conftest import POLICY, ROOT, torchrun


def untied_model(path):
    """A Llama whose lm_head is its own parameter (FSDP2 keeps it in the root unit beside the embedding)."""
    from transformers import AutoModelForCausalLM

    from tinymodel import make_config
    torch.manual_seed(3)
    config = make_config("llama", hidden=128, layers=2, intermediate=256, vocab=64, init_std=0.2)
    config.tie_word_embeddings = False
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def test_response_logprobs_under_fsdp_equal_the_full_vocabulary_ones(arch_models, tmp_path):
    dirs = [str(POLICY), *(str(arch_models[a]) for a in ("llama", "qwen3", "qwen3_moe")),
            str(untied_model(tmp_path / "untied"))]
    torchrun(ROOT / "tests/workers/trainer_fsdp.py", tmp_path, "logprobs", *dirs)
    for rank in (0, 1):
        gaps = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(gaps) == sorted(dirs)
        for model_dir, gap in gaps.items():
            assert gap < 1e-5, model_dir


def test_micro_batching_budgets_and_checkpointing_leave_the_update_unchanged(tmp_path):
    """Token-level normalisation over the whole minibatch, whatever the micro-batches; ranks with fewer
    micro-batches than others run stand-ins that count nothing. Checked where it is well conditioned:
    each minibatch's gradients, and the step's weights under an AdamW made linear in them
    (tests/workers/batches.py's `well_conditioned`)."""
    torchrun(ROOT / "tests/workers/trainer_fsdp.py", tmp_path, "micro-batching", POLICY)
    layers = json.loads((POLICY / "config.json").read_text())["num_hidden_layers"]
    for rank in (0, 1):
        runs = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for minibatches in (1, 2):
            mine = {config.split(", ", 1)[1]: run for config, run in runs.items()
                    if config.startswith(f"{minibatches} minibatches")}
            reference = mine["micro-batch 32"]
            assert reference["moved"] > 1e-3  # the step moved the weights
            for config, run in mine.items():
                # Other micro-batchings give the matrix products other shapes, so their sums run in
                # another order. Summing n fp32 terms in another order moves the sum by at most about
                # n * 2^-24 of its terms' magnitude (Higham, Accuracy and Stability of Numerical
                # Algorithms, 2nd ed., section 4.2); a gradient is such a sum over the positions of every
                # minibatch so far (a later minibatch starts from weights the earlier ones moved), once
                # per decoder layer and once more in the head.
                for k, gap in enumerate(run["grad_gaps"]):
                    bound = (layers + 1) * sum(run["positions"][:k + 1]) * 2 ** -24
                    assert gap <= bound, (config, k, gap, bound)
                bound = (layers + 1) * sum(run["positions"]) * 2 ** -24
                assert abs(run["loss"] - reference["loss"]) <= bound * abs(reference["loss"]), config
                assert abs(run["grad_norm"] - reference["grad_norm"]) <= bound * reference["grad_norm"], config
                assert run["tokens"] == reference["tokens"]
                # a step linear in the gradients moves the weights by as much as their gradients differ
                assert run["weight_gap"] <= bound * reference["moved"], config
                # each rank ran as many micro-steps as the busiest; with checkpointing each layer ran again
                forwards = sum(max(per_rank) for per_rank in run["micro_steps"])
                assert run["layer0_forwards"] == forwards * (2 if "checkpointed" in config else 1), config
            # recomputing a layer in backward gives the very same gradients
            for config in ("budget 120 tokens", "micro-batch 3"):
                assert mine[config]["grad_gaps"] == mine[config + ", checkpointed"]["grad_gaps"]
                assert mine[config]["weight_gap"] == mine[config + ", checkpointed"]["weight_gap"]
        # the ranks' shares of the first minibatch pack into 4 and 3 micro-batches: one rank runs a stand-in
        assert runs["1 minibatches, budget 120 tokens"]["micro_steps"] == [[4, 3]]


def test_betas_warm_up_and_steps_skipped_for_a_non_finite_gradient(tmp_path):
    torchrun(ROOT / "tests/workers/trainer_fsdp.py", tmp_path, "safeguards", POLICY)
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["first"] == {"skipped_updates": 0, "skipped_in_row": 0} and r["steps_before"] == 1
        assert r["betas_gap"] < 1e-9  # the moments follow --adam-betas 0.5,0.6
        nan_1, nan_2, good = r["runs"]
        for run, in_row in ((nan_1, 1), (nan_2, 2)):
            assert run["skipped_updates"] == 1 and run["skipped_in_row"] == in_row
            assert not run["grad_norm_finite"] and run["grads_dropped"]
            # weights and both moments bit for bit as before, and no optimizer step counted
            assert run["unchanged"] and run["steps"] == 1
        assert good["skipped_updates"] == 0 and good["skipped_in_row"] == 0
        assert not good["unchanged"] and good["steps"] == 2
        # --lr-warmup-steps 4: the first step at a quarter of the rate moves each weight a quarter as far,
        # to the rounding of fp32 weights near 1 (6e-8); at the full rate it would be 3/4 of `moved` off
        off, moved = r["warmup"]
        assert moved > 1e-4 and off < 1e-3 * moved
