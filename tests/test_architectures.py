"""Bring-your-own models: Qwen2, Llama, Qwen3 and Qwen3-MoE built from configs, as policy and as GenRM."""
import json

from conftest import ROOT, torchrun


def test_trained_weights_reload_into_vllm_for_each_architecture(arch_models, tmp_path):
    """The trainer's parameter names (transformers 5 fuses a MoE layer's experts) reach vLLM, and the
    engine then decodes greedily exactly as transformers does; the MoE experts train."""
    # qwen2: tests/test_weight_sync.py. The MoE engine comes last, after dense ones in the same process.
    dirs = [arch_models[a] for a in ("llama", "qwen3", "qwen3_moe")]
    torchrun(ROOT / "tests/workers/arch_reload.py", tmp_path, *dirs)
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for model_dir in dirs:
            r = results[str(model_dir)]
            assert r["vllm"] == r["hf"], model_dir
            assert r["moved"]["other"] > 1e-3
            assert r["unloaded"] in ([], ["lm_head.weight"]) and r["unexpected"] == []  # a tied head only
        assert results[str(arch_models["qwen3_moe"])]["moved"]["experts"] > 1e-3
