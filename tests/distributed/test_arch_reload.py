"""Bring-your-own models on two ranks: the trainer's weights of Qwen2, Llama, Qwen3 and Qwen3-MoE, built
from configs, reload into vLLM and export to Hugging Face directories (runs of them as policy and as judge:
tests/e2e/test_architectures.py)."""
import json

from conftest import ROOT, torchrun


def test_trained_weights_reload_into_vllm_and_export_for_each_architecture(arch_models, tmp_path):
    """The trainer's parameter names (transformers 5 fuses a MoE layer's experts) reach vLLM, and the
    engine then decodes greedily exactly as transformers does; the MoE experts train. After two steps
    the exported Hugging Face directory gives transformers the trainer's logits (fp32, within 1e-5) and
    a vLLM engine started from it the reloaded engine's greedy tokens."""
    # The MoE engine comes last, after dense ones in the same process.
    dirs = [arch_models[a] for a in ("qwen2", "llama", "qwen3", "qwen3_moe")]
    torchrun(ROOT / "tests/workers/arch_reload.py", tmp_path, *dirs)
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for model_dir in dirs:
            r = results[str(model_dir)]
            assert r["vllm"] == r["hf"], model_dir
            assert r["moved"]["other"] > 1e-3
            assert r["unloaded"] in ([], ["lm_head.weight"]) and r["unexpected"] == []  # a tied head only
            assert r["logits_gap"] <= 1e-5 and r["vllm_from_export"] == r["vllm"], (model_dir, r)
            assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                    "tokenizer_config.json"} <= set(r["exported_files"]), r["exported_files"]
        assert results[str(arch_models["qwen3_moe"])]["moved"]["experts"] > 1e-3
