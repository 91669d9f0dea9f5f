import json

import pytest

from conftest import POLICY, ROOT, torchrun

pytestmark = pytest.mark.slow


def test_migrated_sequences_match_uninterrupted_ones(tmp_path):
    torchrun(ROOT / "tests/workers/migration.py", POLICY, tmp_path, nproc=1)
    results = json.loads((tmp_path / "rank0.json").read_text())
    lengths = results.pop("lengths")
    assert max(lengths) > 9  # the cuts fall mid-generation
    for cuts, r in results.items():
        assert r["same_tokens"], cuts
        assert r["logprob_gap"] < 1e-4, cuts
        assert r["prefilled_again"] > 0, cuts
