"""Engines of several ranks (--engine-tp): a tensor-parallel vLLM-CPU engine inside the torchrun world."""
import json

from conftest import POLICY, ROOT, torchrun

from roles.engine import SHM_DIR, SHM_PREFIX


def test_a_tp2_engine_loaded_from_storage_answers_as_transformers_and_a_tp1_engine(arch_models, tmp_path):
    """Four ranks at T = 2 (engines on ranks {0, 1} and {2, 3}): each engine, started with dummy weights, loads
    the full-shaped checkpoint from the storage, and then answers greedily as transformers does, dense and MoE
    (a MoE engine after a dense one, so the expert group is the project's); every rank of every engine
    answers the same, and its seeded samples are those of a T = 1 engine on two ranks. A stale segment of a
    launch no longer running is removed at the start, and the run leaves none of its own behind."""
    dirs = [POLICY, arch_models["qwen3_moe"]]
    stale = SHM_DIR / f"{SHM_PREFIX}999999-0-tp:0-[0-1]-cpushm_0"
    stale.write_bytes(b"left by a crash")
    torchrun(ROOT / "tests/workers/tp_engine.py", tmp_path, 2, *dirs, nproc=4)
    torchrun(ROOT / "tests/workers/tp_engine.py", tmp_path, 1, *dirs, nproc=2)
    assert not stale.exists()
    assert not list(SHM_DIR.glob(f"{SHM_PREFIX}*"))
    tp1 = json.loads((tmp_path / "tp1-rank0.json").read_text())
    for rank in range(4):
        results = json.loads((tmp_path / f"tp2-rank{rank}.json").read_text())
        for model_dir in map(str, dirs):
            r = results[model_dir]
            assert r["vllm"] == r["hf"], (rank, model_dir, r)
            assert r["dummy"] != r["vllm"]  # the answers came from the storage's weights
            assert r["sampled"] == tp1[model_dir]["sampled"], (rank, model_dir)
