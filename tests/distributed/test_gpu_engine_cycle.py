import json

from conftest import ROOT, torchrun


def test_sleep_mode_engine_wakes_loads_and_sleeps_in_order(tmp_path, tiny_models):
    """On GPU (see tests/workers/gpu_engine_cycle.py): the policy's engine starts asleep, wakes its weights,
    reloads every weight from storage and only then wakes its KV cache, on each arrival and at the first
    apply; it sleeps at level 2 on leaving. The judge's engine never sleeps and loads once."""
    torchrun(ROOT / "tests/workers/gpu_engine_cycle.py", *tiny_models, tmp_path, nproc=1)
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["created"] == [["policy", "sleep 2"]]
    steps = {label: step["log"] for label, step in result["steps"].items()}

    def calls(log):  # ["policy", "reload 50 tensors, first 0.1"] -> ("policy", "reload")
        return [(who, "reload" if what.startswith("reload") else what) for who, what in log]

    def first_value(event):  # the first element of the first tensor reloaded: which version it was
        return float(event[1].rsplit(" ", 1)[1])

    first = steps["first apply, rollout kept"]
    assert calls(first) == [("policy", "wake weights"), ("policy", "reload"), ("policy", "wake kv_cache")]
    assert calls(steps["to judge"]) == [("policy", "reset prefix cache"), ("policy", "sleep 2"), ("judge", "reload")]
    back = steps["back to rollout"]
    # the judge is drained and not put to sleep (no sleep mode); the policy's engine, discarded asleep,
    # loads the version it held again
    assert calls(back) == [("judge", "reset prefix cache"), ("policy", "wake weights"), ("policy", "reload"),
                           ("policy", "wake kv_cache")]
    assert first_value(back[2]) == first_value(first[1])
    kept = steps["rollout kept, new version"]
    assert calls(kept) == [("policy", "reload")]  # awake: the new version, no wake
    assert abs(first_value(kept[0]) - (first_value(first[1]) + 1)) < 1e-6  # published as v0 + 1 in fp32
    assert steps["to judge again"] == [["policy", "reset prefix cache"], ["policy", "sleep 2"]]  # judge holds v0
    assert result["steps"]["to judge again"]["bytes"] == [0]
