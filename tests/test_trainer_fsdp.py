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
