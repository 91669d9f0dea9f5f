"""The simulator's event engine and calibration loader: small runs, seconds."""
import copy
import json

import numpy as np
import pytest

import planner
from sim import calibration as C
from sim.engine import Simulation


@pytest.fixture(scope="module")
def cal():
    return C.load()


def run(cal, placement, slots=8, prompts=8, steps=2, interval=1.0, group="dense-8b-32b"):
    model = C.GpuModel(cal, group)
    config = planner.PlannerConfig(early_train=True, min_train_ranks=model.min_train_slots)
    sim = Simulation(model, C.gpu_workload(cal, prompts), slots, placement, config=config, interval=interval)
    pushes = []
    push = sim._push
    sim._push = lambda t, *a: (pushes.append((t, sim.now)), push(t, *a))
    return sim, sim.run(steps), pushes


@pytest.mark.parametrize("placement", ["colocated", "disaggregated", "pivot"])
def test_every_sample_generated_judged_and_trained_once(cal, placement):
    sim, result, pushes = run(cal, placement, interval=0.2)
    step = sim.step
    assert (step.phase == 4).all() and step.generated == step.judged == step.n == 8 * 16
    assert step.train_done == step.train_ready == float((step.prompt + step.length).sum())
    assert (step.gen == step.length).all() and (step.cgen == step.critique).all()  # no token lost or repeated
    assert result.samples == 2 * step.n and all(s > 0 for s in result.step_seconds)
    assert all(t >= now - 1e-9 for t, now in pushes)  # no event scheduled in the past
    if placement == "pivot":
        assert result.shifts > 0


def test_pivot_migrates_and_still_loses_nothing(cal):
    sim, result, _ = run(cal, "pivot", slots=16, prompts=16, interval=0.05)
    assert result.shifts > 2 * 16  # more than the step-end moves: the planner moved slots mid-step
    assert sim.step.judged == sim.step.n


def test_the_clock_never_runs_backwards(cal):
    sim, result, _ = run(cal, "pivot", steps=3)
    assert sum(result.step_seconds) == pytest.approx(result.seconds)


def test_calibration_figures_have_value_unit_and_source(cal):
    for path, message in (("h200.hbm_bytes_per_s.source", "h200.hbm_bytes_per_s: no source"),
                          ("models.qwen3-8b.layers.unit", "models.qwen3-8b.layers: no unit"),
                          ("workload.group_size.value", "workload.group_size: no numeric value")):
        broken = copy.deepcopy(cal)
        node = broken
        *parents, leaf = path.split(".")
        for key in parents:
            node = node[key]
        del node[leaf]
        with pytest.raises(C.CalibrationError, match=message):
            C.validate(broken)


def test_calibration_rejects_unknown_models_and_bare_numbers(cal, tmp_path):
    broken = copy.deepcopy(cal)
    broken["groups"]["dense-8b-32b"]["genrm"] = "qwen9"
    with pytest.raises(C.CalibrationError, match="groups.dense-8b-32b.genrm: no model 'qwen9'"):
        C.validate(broken)
    broken = copy.deepcopy(cal)
    broken["h200"]["memory_bytes"] = 141e9
    path = tmp_path / "c.json"
    path.write_text(json.dumps(broken))
    with pytest.raises(C.CalibrationError, match="h200.memory_bytes: not a figure"):
        C.load(path)


def test_gpu_model_is_memory_bound_at_small_batch(cal):
    model = C.GpuModel(cal, "moe-30b-a3b-32b")
    one, many = model.step_seconds("rollout", 1, 3000), model.step_seconds("rollout", 64, 64 * 3000)
    assert one < many < 64 * one  # batching amortises the weights' read
    assert model.slot_gpus == 1 and C.GpuModel(cal, "moe-235b-a22b-32b").slot_gpus == 8


def test_cpu_model_names_the_measurements_it_needs(cal):
    with pytest.raises(C.CalibrationError, match="rollout_step_s"):
        C.CpuModel(cal, {})
    measured = {key: 1 for key in C.CPU_MEASURED} | {
        "rollout_step_s": 0.01, "rollout_per_seq_s": 1e-4, "genrm_step_s": 0.01, "genrm_per_seq_s": 1e-4,
        "rollout_prefill_per_s": 5e3, "genrm_prefill_per_s": 5e3, "train_tokens_per_s": 2e3, "max_seqs": 64,
        "prompts_per_step": 16, "group_size": 8, "prompt_tokens": 20, "response_lengths": [10, 20, 60],
        "critique_lengths": [30, 40], "max_response_tokens": 64, "max_critique_tokens": 96}
    model, workload = C.CpuModel(cal, measured), C.cpu_workload(measured)
    result = Simulation(model, workload, 4, "pivot", config=planner.PlannerConfig()).run(1)
    assert result.samples == 128
    assert set(np.unique(workload.responses(np.random.default_rng(0), 100))) <= {10, 20, 60}
