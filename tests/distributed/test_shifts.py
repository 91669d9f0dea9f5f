import json
import itertools

import pytest

from conftest import ROOT, torchrun
from shifting.context import ROLES, STAGES


def test_every_shift_pair_then_resize_on_two_ranks(tmp_path, tiny_models):
    torchrun(ROOT / "tests/workers/shifts.py", *tiny_models, tmp_path)
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert results[0]["records"] == results[1]["records"]  # every rank reports every rank's shifts
    records = results[0]["records"]
    pairs = {(r["from"], r["to"]) for r in records if r["from"] != r["to"]}
    assert pairs == set(itertools.permutations(ROLES, 2))
    for r in records:
        assert {"rank", "from", "to", "seconds", "bytes", *STAGES} <= set(r)
        # Every arrival loads from storage, but for an engine that holds the stored version already
        # (on CPU it keeps its weights while away): the frozen judge after its first load.
        # the shift's time is its stages' time, each stage measured
        assert all(r[stage] >= 0 for stage in STAGES) and r["seconds"] > 0
        assert r["seconds"] == pytest.approx(sum(r[stage] for stage in STAGES))
        assert r["bytes"] > 0 or r["to"] == "judge"
    assert any(r["to"] == "judge" and r["bytes"] == 0 for r in records)
    for result in results:
        # each arrival's work was right: engines serve the storage's current weights (the policy's
        # latest version after every train visit), and the shifted trainer's master weights, moments
        # and step equal, bit for bit, those of a trainer that never left
        assert result["checks"] and all(ok for _, ok in result["checks"]), result["checks"]
        assert {role for role, _ in result["checks"]} == {"rollout", "judge", "train state before step",
                                                          "train state after step"}
        # resized 2 -> 1 -> 2 mid-run, the group ends where the unresized one does
        assert result["resize_gap"] < 1e-6
