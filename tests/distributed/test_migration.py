import json

from conftest import POLICY, ROOT, torchrun


def test_migrated_sequences_match_uninterrupted_ones(tmp_path):
    torchrun(ROOT / "tests/workers/migration.py", POLICY, tmp_path, nproc=1)
    results = json.loads((tmp_path / "rank0.json").read_text())
    assert results.pop("overfull_finished") == 120  # seeded prompts overfilling an engine step, all done
    lengths = results.pop("lengths")
    across = results.pop("across_versions")
    # resumed under newer weights: the old tokens kept, the rest the new weights', each stretch's version
    assert across["kept_old_tokens"] and across["new_weights_go_on"] and across["logprobs_per_token"]
    assert across["changed"]  # the new weights chose other tokens: the check above is not vacuous
    assert across["versions"] == ["[(0, 0), (3, 1)]"]
    assert max(lengths) > 9  # the cuts fall mid-generation
    for cuts, r in results.items():
        assert r["same_tokens"], cuts
        assert r["logprob_gap"] < 1e-4, cuts
        assert r["prefilled_again"] > 0, cuts
