"""Early training changes when the update's gradients are computed, not the update."""
import json

import pytest

from conftest import POLICY, ROOT, torchrun
from algorithm import LOSS_AGGS


def test_early_training_gives_the_update_of_the_whole_step(tmp_path):
    """Under each --loss-agg: its weights are each response's own, so early sums add up to the step's."""
    torchrun(ROOT / "tests/workers/early_train.py", POLICY, tmp_path)
    for rank, agg in ((rank, agg) for rank in (0, 1) for agg in LOSS_AGGS):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())[agg]
        assert r["early_samples"] == 12  # three groups of four
        assert r["moved"] > 1e-4  # the step changes the weights, so the gaps below mean something
        # early groups trained on rank 1 alone, carried through storage to both ranks
        assert r["stored_tokens"] == r["early_tokens"] > 0
        # The early groups' gradients are sums in another order: a step linear in the gradients
        # (tests/workers/batches.py's `well_conditioned`) then moves the weights by a different amount only
        # to the extent of fp32 rounding, n * 2^-24 for a sum of n terms (Higham, Accuracy and Stability of
        # Numerical Algorithms, 2nd ed., section 4.2), over the step's positions, per decoder layer and head.
        layers = json.loads((POLICY / "config.json").read_text())["num_hidden_layers"]
        bound = (layers + 1) * r["positions"] * 2 ** -24 * r["moved"]
        assert r["carried_gap"] <= bound
        # early groups trained on the final group itself
        assert r["in_place_gap"] <= bound
        carried, in_place, whole = r["stats"]
        for stats in (carried, in_place):
            assert stats["tokens"] == whole["tokens"]
            assert stats["loss"] == pytest.approx(whole["loss"], rel=1e-5, abs=1e-7)
            assert stats["clip_frac"] == pytest.approx(whole["clip_frac"], abs=1e-9)
            # every forward pass, early or not, scores the step's tokens with the weights that sampled them
            assert stats["logprob_gap_mean"] == pytest.approx(whole["logprob_gap_mean"], rel=1e-5)
            assert stats["logprob_gap_max"] == pytest.approx(whole["logprob_gap_max"], rel=1e-5)
    for rank in (0, 1):
        runs = json.loads((tmp_path / f"rank{rank}.json").read_text())
        losses = [runs[agg]["stats"][2]["loss"] for agg in LOSS_AGGS]
        assert len(set(losses)) == len(LOSS_AGGS), losses  # three different losses, each kept exact above
