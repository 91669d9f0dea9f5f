import json

from conftest import ROOT, torchrun


def test_checkpoint_and_export_stream_the_state_without_a_full_copy(tmp_path):
    """Exporting the policy from a ~200 MB training state raises the peak resident memory by under a
    quarter of the state, and saving and restoring the state by under a tenth of it: the tensors go from
    the storage's own memory to disk and back, in chunks. The export holds the checkpoint's tensors
    exactly, in 50 MB shards with their index, beside the policy's other files."""
    from safetensors.torch import load_file

    from tinymodel import make_model
    make_model(str(tmp_path / "policy"), hidden=512, layers=4, intermediate=2048)
    torchrun(ROOT / "tests/workers/checkpoint_memory.py", tmp_path, tmp_path / "policy", nproc=1)
    m = json.loads((tmp_path / "memory.json").read_text())
    print("peak resident memory, KiB:", m)
    assert m["exact"] and m["nbytes"] > 150e6, m
    assert m["exported_kb"] < 0.25 * m["nbytes"] / 1024, m
    # the checkpoint's save exports the policy too, in one 67 MB file
    assert m["saved_kb"] < 0.25 * m["nbytes"] / 1024, m
    assert m["restored_kb"] < 0.1 * m["nbytes"] / 1024, m

    original = load_file(tmp_path / "policy/model.safetensors")
    index = json.loads((tmp_path / "model/model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and sorted(index["weight_map"]) == sorted(original)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in original.values())
    for model, files in ((tmp_path / "model", files), (tmp_path / "checkpoints/step-000001/model", ["model.safetensors"])):
        exported = {name: t for f in files for name, t in load_file(model / f).items()}
        assert sorted(exported) == sorted(original)
        assert all(exported[name].dtype == t.dtype and exported[name].equal(t) for name, t in original.items())
        for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            assert (model / name).read_bytes() == (tmp_path / "policy" / name).read_bytes(), name
