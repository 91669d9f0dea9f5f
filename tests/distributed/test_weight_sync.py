import json

from conftest import POLICY, ROOT, torchrun


def test_grpo_step_on_two_ranks_then_publish_and_reload(tmp_path):
    torchrun(ROOT / "tests/workers/weight_sync.py", POLICY, tmp_path)
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # vLLM's sampling logprobs are the trainer's logprobs of the same tokens
        assert r["logprob_gap"] < 1e-4
        # the sharded step's gradient (token-level mean over both ranks' micro-batches) is the plain one
        assert r["grad_gap"] < 1e-5
        assert r["moved"] > 1e-4  # the step changed the weights the engine now serves
        # after publish and reload, the engine decodes greedily exactly as transformers does
        assert r["vllm"] == r["hf"]
