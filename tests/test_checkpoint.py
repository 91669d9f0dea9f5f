import json

import pytest

from conftest import ROOT, torchrun

pytestmark = pytest.mark.slow


def test_checkpoint_streams_the_state_without_a_full_copy(tmp_path):
    """Saving and restoring a ~200 MB training state raises the peak resident memory by under a tenth of
    it: the state goes from the storage's own memory to disk and back, in chunks."""
    from tinymodel import make_model
    make_model(str(tmp_path / "policy"), hidden=512, layers=4, intermediate=2048)
    torchrun(ROOT / "tests/workers/checkpoint_memory.py", tmp_path, tmp_path / "policy", nproc=1)
    m = json.loads((tmp_path / "memory.json").read_text())
    assert m["exact"] and m["nbytes"] > 150e6, m
    assert m["saved_kb"] - m["before_kb"] < 0.1 * m["nbytes"] / 1024, m
    assert m["restored_kb"] - m["before_kb"] < 0.1 * m["nbytes"] / 1024, m
