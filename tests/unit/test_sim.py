"""The simulator's event engine and calibration loader: small runs, seconds."""
import argparse
import copy
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import pipeline
import planner
from conftest import BENCH_JSON
from roles import ENGINE_ROLES, Role
from sim import calibration as C
from sim.__main__ import simulate, simulate_all
from sim.engine import Round, RoundRules, Simulation, Step
from sim.split import best_split, node_unit



@pytest.fixture(scope="module")
def cal():
    return C.load()


def run(cal, placement, slots=8, prompts=8, steps=2, group="dense-8b-32b", rules=RoundRules(), staleness=0,
        model=None, split=None):
    model = model or C.GpuModel(cal, group)
    config = planner.PlannerConfig(early_train=True, min_train_ranks=model.min_train_slots)
    sim = Simulation(model, C.gpu_workload(cal, prompts), slots, placement, config=config, rules=rules,
                     max_staleness=staleness, split=split)
    pushes = []
    push = sim._push
    sim._push = lambda t, *a: (pushes.append((t, sim.now)), push(t, *a))
    return sim, sim.run(steps), pushes


@pytest.mark.parametrize("placement", ["disaggregated", "pivot"])
def test_the_deep_pipeline_keeps_the_bound_with_up_to_k_plus_one_steps_in_flight(cal, monkeypatch, placement):
    """The deep_pipeline what-if (of the step-locked pipeline) at K = 2: update u trains step u, sampled by
    weights at most K older; up to K + 1 steps are in flight at once, each begun under the weights its
    update may be K ahead of; every sample of a trained step is generated and judged once."""
    in_flight, begun, extend = [], [], Step.extend

    def extended(step, ahead):
        extend(step, ahead)
        in_flight.append(1 + len(step.aheads))
        begun.append((ahead.index, ahead.version))

    monkeypatch.setattr(Step, "extend", extended)
    sim, result, _ = run(cal, placement, rules=RoundRules(deep_pipeline=True, updates="step"), staleness=2, steps=3)
    assert [(u, s) for u, s, _ in result.trained] == [(u, u) for u in range(len(result.trained))]
    assert all(0 <= u - version <= 2 for u, _, version in result.trained)
    assert max(in_flight) == 3 and all(0 <= index - version <= 2 for index, version in begun)
    step = sim.step
    assert (step.gen[:step.n] == step.length[:step.n]).all() and (step.cgen[:step.n] == step.critique[:step.n]).all()


@pytest.mark.parametrize("deep", [False, True])
def test_carried_sequences_go_on_where_they_run_and_lose_nothing(cal, monkeypatch, deep):
    """The carry_running what-if: as a step ends, the engines keep the next steps' sequences, renumbered,
    and export none of them; every sample of a trained step is still generated and judged once."""
    exported, trained, carry, finish = [], [], Simulation._carry, Simulation._finish
    monkeypatch.setattr(Simulation, "_carry", lambda sim, step: exported.append(carry(sim, step)) or exported[-1])
    monkeypatch.setattr(Simulation, "_finish", lambda sim, step: (trained.append(step), finish(sim, step)))
    rules = RoundRules(carry_running=True, deep_pipeline=deep, updates="step" if deep else "ready")
    _, result, _ = run(cal, "pivot", rules=rules, staleness=2, steps=3)
    assert exported and all(e == [] for e in exported)
    assert [(u, s) for u, s, _ in result.trained] == [(u, u) for u in range(len(result.trained))]
    assert all((s.gen == s.length).all() and (s.cgen == s.critique).all() and s.through() for s in trained)


@pytest.mark.parametrize("placement", ["disaggregated", "pivot"])
def test_ready_first_spills_a_tail_into_the_next_step_and_keeps_the_bound(cal, monkeypatch, placement):
    """The loop's default, --updates ready, at K = 2: the pipeline runs at K - 1, and a step may end with up
    to book.SPILL_SHARE of its groups still out, which go on in the next step and are trained with it:
    every sample is generated, judged and trained once, none more than K updates after the weights that
    began it, some groups carried into the next step at K, the rest K - 1."""
    trained, finish, bounded, bound = [], Simulation._finish, [], Simulation._work_bound
    monkeypatch.setattr(Simulation, "_finish", lambda sim, step: (trained.append(step), finish(sim, step)))
    monkeypatch.setattr(Simulation, "_work_bound", lambda sim, step, update: (
        bounded.append((step.carried_in, len(range(step.n)[step.begun_here()]))), bound(sim, step, update))[1])
    sim, result, _ = run(cal, placement, staleness=2, steps=3)
    assert sim.pipe == 1 and sim.ready
    # A timed step's bounds count the work of the samples it began, not again that of the groups carried in
    assert any(carried for carried, _ in bounded) and all(began == 8 * 16 for _, began in bounded)
    assert [s for _, s, _ in result.trained] == list(range(len(trained)))
    stale = [u - step.began for (u, _, _), step in zip(result.trained, trained)]
    assert all(s.max() <= 2 for s in stale)
    after_fill = np.concatenate(stale[1:])  # update 0 trains the fill step under the weights that began it
    assert set(after_fill) == {1, 2} and (after_fill == 1).sum() > (after_fill == 2).sum()
    carried = [step for step in trained if step.carried_in]
    assert carried
    for step in carried:  # its head: the groups carried in, at the bound; the rest its own, one update fresher
        u = next(u for (u, _, _), s in zip(result.trained, trained) if s is step)
        head = step.carried_in * step.group_size
        assert (u - step.began[:head] == 2).all() and (u - step.began[head:] <= 1).all()
    assert all((s.gen == s.length).all() and (s.cgen == s.critique).all() and s.through() for s in trained)
    g = trained[0].group_size  # what a step kept of its own and carried into the next: all of its samples
    assert all(a.n - a.carried_in * g + b.carried_in * g == 8 * 16 for a, b in zip(trained, trained[1:]))
    # Throughput counts a step's draw per timed update; what the three timed updates trained is kept beside it
    assert result.samples == 3 * 8 * 16 and result.trained_samples == sum(step.n for step in trained[:3])


@pytest.mark.parametrize("placement", ["disaggregated", "pivot"])
def test_step_locked_updates_train_step_u_in_update_u_at_lag_k(cal, monkeypatch, placement):
    """--updates step at K = 2: the pipeline runs K deep and every step ends with all its groups judged:
    update u trains all of step u, and every sample of a step rolled out beside an update is exactly K
    updates old when it trains (the fill steps, begun under the first weights, less)."""
    trained, finish = [], Simulation._finish
    monkeypatch.setattr(Simulation, "_finish", lambda sim, step: (trained.append(step), finish(sim, step)))
    sim, result, _ = run(cal, placement, rules=RoundRules(updates="step"), staleness=2, steps=3)
    assert sim.pipe == 2 and not sim.ready
    assert [(u, s) for u, s, _ in result.trained] == [(u, u) for u in range(len(trained))]
    assert all(step.n == 8 * 16 and not step.carried_in for step in trained)
    assert [set(u - step.began) for (u, _, _), step in zip(result.trained, trained)] == \
        [{0}, {1}] + [{2}] * (len(trained) - 2)


def test_the_deep_pipeline_is_a_what_if_of_the_step_locked_one(cal):
    with pytest.raises(ValueError, match="pass updates='step' with it"):
        run(cal, "pivot", rules=RoundRules(deep_pipeline=True), staleness=2)
    with pytest.raises(ValueError, match="updates 'steps': one of ready, step"):
        RoundRules(updates="steps")
    run(cal, "pivot", rules=RoundRules(deep_pipeline=True), staleness=1, steps=1)  # K = 1: both are one


@pytest.mark.parametrize("placement", ["colocated", "disaggregated", "pivot"])
def test_every_sample_generated_judged_and_trained_once(cal, placement):
    sim, result, pushes = run(cal, placement)
    step = sim.step
    assert (step.phase == 4).all() and step.generated == step.judged == step.n == 8 * 16
    assert step.through() and (step.tokens == step.prompt + step.length).all()
    assert (step.gen == step.length).all() and (step.cgen == step.critique).all()  # no token lost or repeated
    assert result.samples == result.trained_samples == 2 * step.n and all(s > 0 for s in result.step_seconds)
    assert all(t >= now - 1e-9 for t, now in pushes)  # no event scheduled in the past
    assert result.rounds > 0
    if placement == "pivot":
        assert result.shifts > 0


def test_pivot_migrates_trains_early_and_still_loses_nothing(cal, monkeypatch):
    early, finish = [], Simulation._finish
    monkeypatch.setattr(Simulation, "_finish", lambda sim, step: (early.append(int(step.trained.sum())),
                                                                  finish(sim, step)))
    sim, result, _ = run(cal, "pivot", slots=16, prompts=16, steps=1)
    assert result.shifts > 2 * 16  # more than the step-end moves: the planner moved slots mid-step
    assert sim.step.judged == sim.step.n
    # Some groups were handed to train slots while the step still ran, each once (Book.train refuses a
    # group twice); the rest at the end, and run() checks that the update trained every group.
    assert 0 < early[-1] < len(sim.step.trained) and sim.step.through()


def test_prefill_intake_holds_work_at_rank_0_and_loses_nothing(cal):
    """The what-if rule (RoundRules.prefill_intake): a pivot engine takes in a timed round no more new
    work than it prefills in it, one request at least; every sample is still generated and judged once."""
    rules = RoundRules(prefill_intake=ENGINE_ROLES)
    sim = Simulation(C.GpuModel(cal, "dense-8b-32b"), C.gpu_workload(cal, 8), 8, "pivot", rules=rules,
                     config=planner.PlannerConfig(early_train=True, min_train_ranks=1))
    taken, dispatch = [], sim._dispatch

    def traced(rnd):
        before = [set(s.running) for s in sim.slots]
        dispatch(rnd)
        for slot, was in zip(sim.slots, before):
            new = [i for i in slot.running if i not in was]
            if new and rnd.seconds is not None:
                speed = sim.speeds.rollout if slot.role == "rollout" else sim.speeds.judge
                taken.append((sim._context(slot.role, new[:-1]), speed.prefill_per_s * rnd.seconds, len(new)))

    sim._dispatch = traced
    sim.run(1)
    assert sim.step.judged == sim.step.n and (sim.step.cgen == sim.step.critique).all()
    assert taken and all(before_last <= budget for before_last, budget, _ in taken)
    assert any(n == 1 for *_, n in taken) and any(n > 1 for *_, n in taken)


def test_the_clock_never_runs_backwards(cal):
    sim, result, pushes = run(cal, "pivot", steps=3)
    handled = [now for _, now in pushes]  # the clock whenever an event was being handled
    assert handled == sorted(handled) and handled[-1] > handled[0]
    assert all(s > 0 for s in result.step_seconds) and sum(result.step_seconds) == pytest.approx(result.seconds)


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
    broken["groups"]["dense-8b-32b"]["judge"] = "qwen9"
    with pytest.raises(C.CalibrationError, match="groups.dense-8b-32b.judge: no model 'qwen9'"):
        C.validate(broken)
    broken = copy.deepcopy(cal)
    broken["h200"]["memory_bytes"] = 141e9
    path = tmp_path / "c.json"
    path.write_text(json.dumps(broken))
    with pytest.raises(C.CalibrationError, match="h200.memory_bytes: not a figure"):
        C.load(path)


def test_gpu_model_is_memory_bound_at_small_batch(cal):
    model = C.GpuModel(cal, "moe-30b-a3b-32b")
    one, many = model.engine_step_seconds("rollout", 1, 3000), model.engine_step_seconds("rollout", 64, 64 * 3000)
    assert one < many < 64 * one  # batching amortises the weights' read
    assert model.slot_gpus == 1 and C.GpuModel(cal, "moe-235b-a22b-32b").slot_gpus == 8


class StepModel(C.CostModel):
    """Every engine step 1 s (a judge step `judge_step_s`), each round's exchange `exchange_s`, nothing else
    costs: a step's time counts engine steps and rounds."""
    slot_gpus, min_train_slots, prefill_chunk_tokens = 1, 1, 1
    prefill_per_s = {"rollout": math.inf, "judge": math.inf}
    max_seqs = {"rollout": 4, "judge": 4}

    def __init__(self, cores=None, exchange_s=0.0, judge_step_s=1.0, shift_s=0.0):
        self.cores, self.exchange_s, self.judge_step_s, self.shift_s = cores, exchange_s, judge_step_s, shift_s

    def engine_step_seconds(self, role, batch, context):
        return 1.0 if role == "rollout" else self.judge_step_s

    def token_seconds(self, role):
        return self.engine_step_seconds(role, 1, 0) / self.max_seqs[role], 0.0

    def shift_seconds(self, src, dst, train_slots, grads):
        return self.shift_s

    def publish_seconds(self, train_slots):
        return 0.0

    def train_per_s(self, train_slots):
        return math.inf

    def exchange_seconds(self, placement, slots):
        return self.exchange_s


def two_slots(model, placement="colocated", rules=RoundRules(), split=None, lengths=(10, 20)):
    """Two slots: responses of `lengths` tokens, then critiques of 5 each."""
    workload = C.Workload(2, 1, 1, max(lengths), 5, lambda rng, n: (np.array(lengths), np.array([5, 5])))
    sim = Simulation(model, workload, len(split or "ab"), placement, config=planner.PlannerConfig(), rules=rules,
                     split=split)
    return sim.run(1)


def test_slots_sharing_cores_slow_each_other_down():
    # Both slots stop at the first round's limit together (no stepping on), so only the cores count.
    alone = RoundRules(step_on=False)
    # Own devices: rollout ends with the 20-token response, then 5 critique steps.
    assert two_slots(StepModel(), rules=alone).seconds == pytest.approx(20 + 5)
    # Two cores for two slots: nothing changes.
    assert two_slots(StepModel(cores=2), rules=alone).seconds == pytest.approx(20 + 5)
    # One core: while both work each step takes 2 s; once the short response is done (at 20 s) the long one
    # has 10 steps left alone, at 1 s each; then both judge together, 2 s a step.
    assert two_slots(StepModel(cores=1), rules=alone).seconds == pytest.approx(2 * 10 + 10 + 2 * 5)


def test_a_round_prefills_beside_every_slot_it_gives_work_to_even_those_still_shifting():
    """Two slots on one core judge after a shift of theirs: each prefills its critique's request (4 s alone)
    beside the other, 8 s, whether the round begins while they shift or once they have: each of the step's
    three shifts (1 s) only delays what follows it. Priced at the moment the round begins, when every slot
    is still shifting, the prefills would run as if alone, 4 s sooner."""
    prefilled = StepModel(cores=1)
    prefilled.prefill_per_s = {"rollout": math.inf, "judge": 1.0}
    still = two_slots(prefilled, lengths=(3, 3))  # a judge prompt: 1 prompt token + 3 response tokens
    prefilled.shift_s = 1.0
    shifting = two_slots(prefilled, lengths=(3, 3))
    assert shifting.seconds - still.seconds == pytest.approx(3.0)  # into judge, into train, back to rollout


def test_a_round_that_ends_stops_a_prefill_after_the_chunk_in_progress():
    """Colocated on two slots, one critique per judge engine, a prefill chunk of one token a second. The
    responses (3, 30 and 20 tokens) are out at 30 s. Slot 0 judges the 3-token one (4 tokens in, 5 out) and
    runs empty 9 s in, which ends the round; slot 1, into the 31 chunks of the 30-token one's critique, stops
    after its 10th, as the loop's engine stops at its first step boundary once it learns of the end. So the
    20-token one's critique (21 chunks, 5 steps) starts on slot 0 10 s in, not 25 s in, once slot 1 had
    taken in the round's 25 chunks, and the last verdict comes 37 s after the last response, not 51 s."""
    model = StepModel()
    model.prefill_per_s, model.max_seqs = {"rollout": math.inf, "judge": 1.0}, {"rollout": 4, "judge": 1}
    lengths = np.array([3, 30, 20])
    workload = C.Workload(3, 1, 1, 30, 5, lambda rng, n: (lengths, np.array([5, 5, 5])))
    r = Simulation(model, workload, 2, "colocated", config=planner.PlannerConfig()).run(1)
    assert r.phases["rollout"] == pytest.approx(30)
    assert r.phases["judge_tail"] == pytest.approx(37)


def test_colocated_rounds_end_with_the_last_engine_and_each_costs_its_exchange():
    """As shifting/scheduler.py colocated_roles orders them: with prompts queued the first rollout round is
    timed (25 x the first-step guess of 2 ms, no exchange timed yet in the step: StepQueues.exchange_s),
    then one round until every engine has run empty; the judge's round is timed at 25 x the median step
    seen (1 s), which outlasts its critiques. In the first round both slots pass the limit with their first
    step, at 1 s: the first to arrive steps on, the last stops there and waits 1 s for that step."""
    r = two_slots(StepModel(exchange_s=0.5))
    assert r.rounds == 3
    assert r.seconds == pytest.approx(1 + 20 + 5 + 3 * 0.5)
    assert r.slot_seconds["exchange"] == pytest.approx(2 * 3 * 0.5)
    assert r.slot_seconds["waiting"] == pytest.approx(1)
    # The slot whose response ended at 10.5 s idles until the other's does, at 21.5 s.
    assert r.slot_seconds["rollout idle"] == pytest.approx(11)


def test_a_slot_past_the_round_limit_waits_for_a_long_step():
    """Disaggregated, one rollout slot and one judge slot whose steps take 30 s: while the long response
    rolls out, each round lasts the judge's step. With rounds of 25 x the median step (1 s) alone,
    stopping at the limit, the rollout slot would wait 5 s of it with work in hand, in each of the five
    rounds of the judge's critique; stepping on until every slot reaches the limit (the loop's rule)
    leaves only the judge's wait for the rollout slot's step in progress (1 s), in the four rounds that
    end so. Rounds of at least 10 of the longest steps (the loop's rule too) outlast the critique: one
    such wait."""
    split, lengths = {"rollout": 1, "judge": 1, "train": 1}, (10, 200)
    model = StepModel(judge_step_s=30.0)
    held = two_slots(model, "disaggregated", RoundRules(step_on=False, over_longest=0), split=split, lengths=lengths)
    assert held.slot_seconds["waiting"] == pytest.approx(5 * 5)
    free = two_slots(model, "disaggregated", RoundRules(over_longest=0), split=split, lengths=lengths)
    assert free.slot_seconds["waiting"] == pytest.approx(4 * 1)
    assert free.seconds == pytest.approx(held.seconds - 25)
    long = two_slots(model, "disaggregated", split=split, lengths=lengths)
    assert long.slot_seconds["waiting"] == pytest.approx(1) and long.rounds < free.rounds


def test_cpu_path_runs_on_what_the_bench_writes(cal):
    """tests/data/placements_cpu.json: bench/placements.py --json's cost-model keys from a real run (its
    length lists cut short)."""
    measured = json.loads(BENCH_JSON.read_text())
    for key in ("rollout_step_s", "exchange_per_round_s"):
        with pytest.raises(C.CalibrationError, match=key):
            C.CpuModel(cal, {k: v for k, v in measured.items() if k != key})
    model = C.CpuModel(cal, measured)
    assert model.shift_seconds("rollout", "judge", 4, False) == measured["shift_s"]["rollout->judge"]  # the runs' own
    args = argparse.Namespace(calibration="cpu", measured=str(BENCH_JSON), steps=2, prompts=None,
                              preset="h200", max_staleness=0, updates="ready", search_split=False, timeline=None)
    r = simulate(cal, "cpu", measured["nproc"], args)
    assert r["placements"]["disaggregated@0"]["split"] == {"rollout": 2, "judge": 1, "train": 1}
    for p in r["placements"].values():
        assert p["samples_per_s"] * sum(p["step_s"]) == pytest.approx(2 * measured["prompts_per_step"]
                                                                      * measured["group_size"])
    assert r["placements"]["pivot@0"]["shifts"] > 0 and r["placements"]["colocated@0"]["shifts"] > 0
    # Colocated on the built-in task: a timed first round, then until every engine is empty, for rollout
    # and for the judge; the ranks' report to rank 0 as measured after each.
    assert r["placements"]["colocated@0"]["rounds"] == 2 * 4


def test_runs_side_by_side_give_the_figures_one_process_gives(cal):
    """`python -m sim --jobs 2`: each (group, seed) run in a process of its own gives what one process running
    them in turn gives, seed by seed."""
    args = argparse.Namespace(calibration="cpu", measured=str(BENCH_JSON), steps=2, prompts=None,
                              gpus=json.loads(BENCH_JSON.read_text())["nproc"], preset="h200", max_staleness=2,
                              updates="ready", search_split=False, timeline=None, jobs=1)
    one = simulate_all(cal, ["cpu"], [0, 1], args)
    two = simulate_all(cal, ["cpu"], [0, 1], argparse.Namespace(**{**vars(args), "jobs": 2}))
    assert one == two and list(one[0]) == ["0", "1"]
    assert one[0]["0"]["placements"]["pivot@2"]["step_s"] != one[0]["1"]["placements"]["pivot@2"]["step_s"]


@pytest.mark.parametrize("placement, staleness", [("colocated", 0), ("pivot", 0), ("pivot", 2), ("disaggregated", 2)])
def test_the_timeline_accounts_for_every_slots_work_and_shifts(cal, placement, staleness):
    """`--timeline`'s spans hold what the device-seconds table counts: over the timed updates, each role's
    work and the shifting, slot by slot, with no slot in two spans at once."""
    model = C.GpuModel(cal, "dense-8b-32b")
    sim = Simulation(model, C.gpu_workload(cal, 8), 8, placement, max_staleness=staleness,
                     config=planner.PlannerConfig(early_train=True, min_train_ranks=model.min_train_slots))
    sim.spans = []
    result = sim.run(2, skip=1)
    start, end = sim.origin, sim.origin + result.seconds
    held = lambda s: max(0.0, min(s["end"], end) - max(s["start"], start))  # noqa: E731
    for role in ("rollout", "judge", "train", "shift"):
        counted = result.slot_seconds["shifting" if role == "shift" else role]
        assert sum(held(s) for s in sim.spans if s["role"] == role) == pytest.approx(counted, rel=1e-9, abs=1e-9)
    for rank in range(8):
        mine = sorted((s["start"], s["end"]) for s in sim.spans if s["rank"] == rank)
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(mine, mine[1:]))
    assert any(s["role"] == "shift" and s["from"] != s["to"] for s in sim.spans) == (placement != "disaggregated")


def test_the_timeline_is_written_and_drawn_as_a_runs(cal, tmp_path):
    measured = json.loads(BENCH_JSON.read_text())
    args = argparse.Namespace(calibration="cpu", measured=str(BENCH_JSON), steps=2, prompts=None,
                              preset="h200", max_staleness=2, updates="ready", search_split=False,
                              timeline=str(tmp_path))
    r = simulate(cal, "cpu", measured["nproc"], args)
    for name in r["placements"]:
        folder = tmp_path / "cpu" / name
        spans = [json.loads(line) for line in (folder / "timeline.jsonl").read_text().splitlines()]
        assert spans and {s["rank"] for s in spans} <= set(range(measured["nproc"]))
        assert (folder / "timeline.png").stat().st_size > 0
        assert (folder / "timeline_step.png").exists() == any(s["role"] == "shift" for s in spans)


def test_the_cpu_workload_deals_whole_measured_groups():
    """A prompt's responses are alike in length on the built-in task: the replay draws a measured group's
    (response, critique) lengths together, not each length on its own."""
    measured = json.loads(BENCH_JSON.read_text())
    g = measured["group_size"]
    seen = {tuple(zip(r, c)) for r, c in zip(np.reshape(measured["response_lengths"], (-1, g)).tolist(),
                                              np.reshape(measured["critique_lengths"], (-1, g)).tolist())}
    workload = C.cpu_workload(measured)
    lengths, critiques = workload.draw(np.random.default_rng(0))
    drawn = [tuple(zip(r, c)) for r, c in zip(lengths.reshape(-1, g).tolist(), critiques.reshape(-1, g).tolist())]
    assert len(drawn) == measured["prompts_per_step"] and all(group in seen for group in drawn)
    assert len(set(lengths.tolist())) > 1  # still a draw: groups of different lengths
    with pytest.raises(C.CalibrationError, match="whole groups of 8"):
        C.cpu_workload(measured | {"critique_lengths": measured["critique_lengths"][:-1]})


def test_a_shift_the_bench_did_not_make_costs_as_the_dearest_measured_one_of_its_kind(cal):
    """Not a figure measured on another model (bench/shift_latency.py's), while the runs measured a shift
    that does the same work on theirs."""
    measured = json.loads(BENCH_JSON.read_text())
    measured["shift_s"] = {"rollout->judge": 0.001, "judge->train": 0.05, "train->rollout": 0.2, "train->judge": 0.3}
    model = C.CpuModel(cal, measured)
    assert model.shift_seconds("rollout", "train", 1, False) == 0.05  # into train
    assert model.shift_seconds("train", "train", 2, True) == 0.05
    assert model.shift_seconds("rollout", "rollout", 1, False) == 0.3  # out of train: the weights loaded
    assert model.shift_seconds("judge", "rollout", 1, False) == 0.001  # between the engines
    measured["shift_s"] = {"judge->train": 0.05}
    model = C.CpuModel(cal, measured)  # no shift out of train measured: calibration.json's dearest
    assert model.shift_seconds("rollout", "rollout", 1, False) == C.value(cal, "cpu.shift_s.train->rollout")


def test_engine_steps_are_slowed_by_what_the_bench_measured_at_each_contention_level(cal):
    """Where the bench measured enough decode-only steps at a level of ranks working, what they took over
    the fit and the law counts on top of the law; elsewhere, and for a JSON without the figures, the law."""
    measured = json.loads(BENCH_JSON.read_text())
    for role in ("rollout", "judge"):  # the recording's own decode-only figures left out
        for level in measured[f"{role}_by_busy_ranks"].values():
            for key in ("decode_steps", "decode_measured_s", "decode_predicted_s"):
                level.pop(key, None)
    assert C.CpuModel(cal, measured).engine_sharing("judge", 4) == C.shared_cores(4, 2) == 2.0
    measured["judge_by_busy_ranks"]["4"] |= {"decode_steps": C.SHARING_MIN_STEPS, "decode_measured_s": 0.03,
                                             "decode_predicted_s": 0.02}
    measured["judge_by_busy_ranks"]["3"] |= {"decode_steps": C.SHARING_MIN_STEPS - 1, "decode_measured_s": 0.03,
                                             "decode_predicted_s": 0.02}
    model = C.CpuModel(cal, measured)
    assert model.engine_sharing("judge", 4) == pytest.approx(2.0 * 1.5)
    assert model.engine_sharing("judge", 3) == 1.5 and model.engine_sharing("rollout", 4) == 2.0
    assert model.engine_sharing("judge", 7) == 3.5  # a level the bench never saw


@pytest.mark.parametrize("placement", ["colocated", "disaggregated", "pivot"])
def test_phases_and_slot_states_account_for_the_run(cal, placement):
    sim, result, _ = run(cal, placement, slots=8)
    assert sum(result.phases.values()) == pytest.approx(result.seconds)
    assert sum(result.slot_seconds.values()) == pytest.approx(8 * result.seconds)
    assert all(v >= 0 for v in [*result.phases.values(), *result.slot_seconds.values()])
    moves = result.shifts * result.shift_seconds
    if placement == "disaggregated":  # its rollout slots also reload each new version, which is no move
        assert result.slot_seconds["shifting"] > moves
    else:
        assert result.slot_seconds["shifting"] == pytest.approx(moves)
    assert 0 < result.busy_fraction < 1
    assert result.seconds >= result.critical_path_s > 0  # no placement beats its slowest sample


def test_one_slot_is_idle_only_while_it_shifts_or_reports(cal):
    sim, result, _ = run(cal, "colocated", slots=1, prompts=2)
    assert sum(v for k, v in result.slot_seconds.items() if k.endswith("idle")) == pytest.approx(0, abs=1e-9)
    overhead = result.shifts * result.shift_seconds + result.slot_seconds["exchange"]
    assert result.busy_fraction == pytest.approx(1 - overhead / result.seconds)


@pytest.mark.parametrize("placement, seconds, shifts, rounds", [("colocated", 361.38139483401704, 48, 8),
                                                               ("disaggregated", 420.9172163317409, 0, 193),
                                                               ("pivot", 300.3647451887757, 56, 211)])
def test_at_k0_the_figures_are_those_before_the_pipeline(cal, placement, seconds, shifts, rounds):
    """What the synchronous simulator gave for these runs before it ran pivot_train.py's pipeline, to the
    last digit (commit f307166 with the scheduling book's load-evening dispatch and the planner's count of
    idle engine ranks, which came beside it), but for the timed rounds' length: its longest recent engine
    step is now the longest of the step's last 256 engine steps per rank, as the loop takes it
    (book.RecentSteps), where it was the longest of the last 256 runs of steps at one speed; and a slot
    still shifting (or loading new weights) takes its share of the queue at the round's start and starts
    on it once shifted, as the loop's rank does (sim/replay.py found that the simulator gave it none); and
    the ranks learn of a round's end from a wait on the store, book.NOTICE_S after it, where they looked
    it up every 10 ms (5 ms later on average); and a slot taking in its new work stops, as a round ends, after
    the prefill chunk in progress, where it went on through the round's chunks; and a slot that begins the
    round late (its shift) arrives once the engine step in progress is over (its first prefill chunk), as
    the loop's rank arrives only between two engine steps, where it arrived as the step began and every
    slot stopped for that chunk. Pivot's judge engines take up
    to their room here, as they did then (RoundRules.intake and prefill_budget off; book.intake and
    book.prefill_budget came after), and the sequences a slot leaving its role exports are queued at the next
    exchange, as they were then (RoundRules.migrate_at_once off)."""
    sim, result, _ = run(cal, placement, rules=RoundRules(intake=False, prefill_budget=False, migrate_at_once=False))
    assert (result.seconds, result.shifts, result.rounds) == (seconds, shifts, rounds)
    assert result.critical_path_s == 205.0381855320795


def test_the_pipeline_rule_orders_steps_as_the_loop_did():
    """pipeline.rollouts against the loop pivot_train.rollout_for_update ran before it called the rule:
    fill `pending` while it holds fewer than min(K, steps left), then roll out step u + K beside update u,
    which trains the oldest pending step (at K = 0, the one rolled out beside it)."""
    for k in range(4):
        for steps in range(1, 7):
            pending = []
            for update in range(steps):
                fill = []
                while len(pending) + len(fill) < min(k, steps - update):
                    fill.append(update + len(pending) + len(fill))
                ahead, beside = pipeline.rollouts(update, len(pending), k, steps)
                assert (list(ahead), beside) == (fill, update + k)
                pending += fill
                assert (pending.pop(0) if k else beside) == update  # update u trains step u
                if k and beside < steps:
                    pending.append(beside)
            assert pending == []


@pytest.mark.parametrize("placement", ["disaggregated", "pivot"])
def test_at_k2_every_step_trains_once_and_never_beyond_the_bound(cal, placement):
    sim, result, _ = run(cal, placement, staleness=2, rules=RoundRules(updates="step"))
    # Two timed updates, then the two that roll nothing out; the two fill steps rolled out before any.
    assert [u for u, _, _ in result.trained] == [0, 1, 2, 3]
    assert [step for _, step, _ in result.trained] == [0, 1, 2, 3]  # update u trains step u, each once
    assert [version for _, _, version in result.trained] == [0, 0, 0, 1]  # steps 2 and 3 rolled out beside 0, 1
    assert all(0 <= u - version <= 2 for u, _, version in result.trained)
    assert len(result.step_seconds) == 2 and result.samples == result.trained_samples == 2 * 8 * 16


def test_at_k2_the_split_trains_the_earlier_step_while_the_next_rolls_out(cal):
    """Disaggregated's train slots wait through a synchronous step's rollout and train after its last
    verdict; at K = 2 they work through the update's groups, an earlier step's, all judged, meanwhile,
    and little of the update is left after the verdict."""
    split = {"rollout": 3, "judge": 2, "train": 3}
    runs = {k: run(cal, "disaggregated", staleness=k, split=split)[1] for k in (0, 2)}
    assert runs[2].phases["train_tail"] < runs[0].phases["train_tail"] / 10
    assert runs[2].seconds < runs[0].seconds


def test_train_slots_past_their_time_stop_at_the_group_boundary_once_the_others_have_arrived(cal):
    """The loop's train ranks look at the round's end between two groups (RoundEnd.stop in _train): past
    their time they arrive at the end of the group in progress, and, the last to arrive, stop there. In
    the split's first round of early training the engine slots have arrived long before the first group
    is through (its time is a fraction of one group's): the engine slots step on meanwhile, waiting for
    nothing, and the train slots train that group and no other."""
    model = C.GpuModel(cal, "dense-8b-32b")
    sim = Simulation(model, C.gpu_workload(cal, 8), 8, "disaggregated", max_staleness=2,
                     config=planner.PlannerConfig(early_train=True, min_train_ranks=model.min_train_slots),
                     split={"rollout": 3, "judge": 2, "train": 3})
    rounds, round_ = [], sim._round
    trained = lambda book: float(book.tokens[np.repeat(book.trained, book.group_size)].sum())  # noqa: E731

    def traced(rnd):
        before, waited, start = trained(sim.update) if sim.update is not None else 0.0, sim.slot_s["waiting"], sim.now
        worked = round_(rnd)
        if sim.update is not None:
            rounds.append((sim.update, trained(sim.update) - before, sim.slot_s["waiting"] - waited, sim.now - start))
        return worked

    sim._round = traced
    sim.run(1)
    update, trained, waited, seconds = next(r for r in rounds if r[1])
    assert trained == pytest.approx(float(update.drawn_tokens(update.members(0)).sum()))
    assert waited < 0.01 * seconds * len(sim.slots)


@pytest.mark.parametrize("placement, staleness", [("colocated", 0), ("disaggregated", 0), ("disaggregated", 2),
                                                  ("pivot", 0), ("pivot", 2)])
@pytest.mark.parametrize("preset", ["h200", "paper"])
def test_no_placement_beats_its_bound(cal, placement, staleness, preset):
    """The bound (Simulation.run: the work at the best rate per slot, or the critical path over K + 1
    steps) is below every simulated step, on each preset's cost model."""
    cal = C.preset(cal, preset)
    model = C.FittedGpuModel(cal, "qwen25-1b5+glm-z1-9b") if preset == "paper" else C.GpuModel(cal, "dense-8b-32b")
    _, result, _ = run(cal, placement, prompts=4, staleness=staleness, model=model)
    assert result.seconds >= result.bound_s >= result.work_bound_s > 0
    assert result.bound_s >= result.critical_path_s / (staleness + 1)


def test_the_split_search_finds_the_best_split(cal):
    """Against every split of a small case, each simulated alike (disaggregated at K = 2)."""
    model = C.GpuModel(cal, "dense-8b-32b")

    def seconds(split):
        return run(cal, "disaggregated", prompts=4, steps=1, staleness=2, model=model, split=split)[1].seconds

    found, simulated = best_split(8, model.min_train_slots, seconds)
    every = {(r, g, 8 - r - g): seconds({"rollout": r, "judge": g, "train": 8 - r - g})
             for r in range(1, 7) for g in range(1, 8 - r) if 8 - r - g >= model.min_train_slots}
    assert seconds(found) == min(every.values()) and simulated < len(every)
    assert best_split(16, 1, lambda s: abs(s["train"] - 6) + abs(s["judge"] - 4), unit=2)[0] == \
        {"rollout": 6, "judge": 4, "train": 6}
    assert [node_unit(128, 8, 1), node_unit(16, 8, 1), node_unit(16, 8, 12), node_unit(16, 8, 13)] == [8, 4, 2, 1]


def test_paper_preset_figures_all_have_a_source(cal):
    paper = C.preset(cal, "paper")
    for name in ("h20", "workload", "models", "groups"):
        assert name in cal["paper"] and paper[name] is cal["paper"][name]
    assert paper["loop"] is cal["loop"] and paper["planner"] is cal["planner"]  # the loop's settings stay

    def leaves(node, where):
        if isinstance(node, dict) and "value" in node:
            yield where, node
        elif isinstance(node, dict):
            for key, child in node.items():
                yield from leaves(child, f"{where}.{key}")

    figures = list(leaves(cal["paper"], "paper"))
    assert len(figures) > 100 and all(f["source"].strip() and f["unit"].strip() for _, f in figures)
    broken = copy.deepcopy(cal)
    del broken["paper"]["models"]["qwen2.5-7b"]["decode_kv_s"]["source"]
    with pytest.raises(C.CalibrationError, match="paper.models.qwen2.5-7b.decode_kv_s: no source"):
        C.validate(broken)
    for group in paper["groups"]:
        C.FittedGpuModel(paper, group)


def test_paper_decode_fit_gives_the_steps_the_release_measured(cal):
    """victor-yfzhao/psrl examples/bench/rollout/exp/summary/fitted_cost_models.json: the steps measured
    with attention off (so no KV term and no D), at batch 1 and the largest batch measured."""
    paper = C.preset(cal, "paper")
    for group, measured in (("qwen25-7b+qwen3-30b-a3b", {1: 5.0845e-3, 64: 8.189e-3}),
                            ("qwen25-72b+qwen35-122b-a10b", {1: 8.7825e-3, 128: 23.739e-3})):
        model = C.FittedGpuModel(paper, group)
        fixed = model.fit["rollout"][4]
        for batch, seconds in measured.items():
            n = model.instances["rollout"]
            assert model.engine_step_seconds("rollout", batch * n, 0.0) - fixed == pytest.approx(seconds, rel=0.03)
    broken = copy.deepcopy(paper)
    broken["groups"]["qwen25-7b+qwen3-30b-a3b"]["tp_judge"]["value"] = 2
    with pytest.raises(C.CalibrationError, match="fit is at tensor-parallel size 4"):
        C.FittedGpuModel(broken, "qwen25-7b+qwen3-30b-a3b")


def test_pivot_judge_engines_take_in_no_more_than_the_intake_and_a_joining_slot_finds_work(cal):
    """book.intake: a pivot judge engine never takes in beyond its intake, nor in a timed round beyond what
    it prefills in it (book.prefill_budget: one response at least), so the rest of the responses wait at
    rank 0, and a slot that joins the judge takes some of them in its first round."""
    paper = C.preset(cal, "paper")
    sim = Simulation(C.FittedGpuModel(paper, "qwen25-1b5+glm-z1-9b"), C.gpu_workload(paper, 16), 16, "pivot",
                     config=planner.PlannerConfig(early_train=True, min_train_ranks=1))
    seen, dispatch, last = {"capped": 0, "joined": 0}, sim._dispatch, [s.role for s in sim.slots]

    def traced(rnd):
        held = [len(s.running) for s in sim.slots]
        queued, cap, budget = len(sim.step.queue["judge"]), sim._capacity("judge", rnd.seconds), sim._budget("judge", rnd)
        dispatch(rnd)
        judges = [(slot, len(slot.running) - was, was, before) for slot, was, before in zip(sim.slots, held, last)
                  if slot.role == "judge"]
        left = len(sim.step.queue["judge"])
        for slot, took, was, before in judges:
            assert took == 0 or len(slot.running) <= cap
            # work waits only while every judge engine is full, or in a round whose budget held some back
            assert not left or len(slot.running) >= cap or budget is not None
            if budget is not None and took:  # what it took but its last request, it prefills in the round
                assert sim._context("judge", slot.running[was:-1]) <= budget
            if before != "judge" and queued:
                # A slot that joins takes work first, unless engines as empty took all there was.
                assert took > 0 or not left and all(w == 0 for _, t, w, _ in judges if t), slot.index
                seen["joined"] += took > 0
        seen["capped"] += bool(sim.step.queue["judge"]) and cap < sim.model.max_seqs["judge"]
        last[:] = [s.role for s in sim.slots]

    sim._dispatch = traced
    sim.run(1)
    assert sim.step.judged == sim.step.n
    assert seen["capped"] and seen["joined"]


def test_train_slots_through_their_groups_end_an_early_round_as_an_engine_run_empty(cal):
    """The loop's train ranks through every group handed to them in a timed round end it as a rank whose
    engine runs empty does (RoundEnd.end_now), so the planner may give them other work: on 8 slots one
    empty slot ends a round. Pivot at K = 2, the 1.5B policy and its 9B thinking judge: in the rounds whose
    train slots got through their groups, they idle less than a fifth as long as when they wait for the
    round's end (RoundRules.trained_through off)."""
    paper = C.preset(cal, "paper")
    idled = {}
    for through in (True, False):
        model = C.FittedGpuModel(paper, "qwen25-1b5+glm-z1-9b")
        sim = Simulation(model, C.gpu_workload(paper, 8), 8, "pivot", max_staleness=2,
                         config=planner.PlannerConfig(early_train=True, min_train_ranks=model.min_train_slots),
                         rules=RoundRules(trained_through=through))
        idled[through], round_ = [], sim._round

        def traced(rnd, sim=sim, round_=round_, idle=idled[through]):
            before, handed = sim.slot_s["train idle"], sim.train_left > 0
            trainers = sum(s.role == "train" for s in sim.slots)
            worked = round_(rnd)
            if handed and rnd.early and not sim.train_cut:
                idle.append((sim.slot_s["train idle"] - before) / trainers)
            return worked

        sim._round = traced
        sim.run(2)
    assert idled[True] and idled[False]
    assert sum(idled[True]) < 0.2 * sum(idled[False])


def test_a_slot_that_joins_its_role_late_arrives_after_its_first_step_while_the_others_step_on():
    """A timed round of 2 s on two slots, engine steps of 1 s: slot 0 rolls out a 30-token response; slot
    1 joins the judge 3 s into the round (its shift) and takes in a critique's request of 4 tokens in one
    prefill chunk, at a token a second. The loop's rank looks at the round's end only between two engine
    steps (scheduler.py _work), so slot 1 arrives as that chunk ends, 7 s in, and slot 0, past its limit
    at 2 s, steps on until then and stops after the step it began at 7 s: 8 steps of its response, and
    slot 1 waits 1 s for that step. Were slot 1 to arrive as its chunk began, the round would end 3 s in
    and slot 0 stop after 4 steps."""
    model = StepModel()
    model.prefill_per_s, model.prefill_chunk_tokens = {"rollout": math.inf, "judge": 1.0}, 4
    workload = C.Workload(2, 1, 1, 30, 5, lambda rng, n: (np.array([30, 3]), np.array([5, 5])))
    sim = Simulation(model, workload, 2, "pivot", config=planner.PlannerConfig())
    sim.step = sim._new_step(0, version=0)
    rollout, judge = sim.slots
    rollout.running = [0]
    judge.role, judge.running, judge.ready_at = Role.JUDGE, [1], 3.0
    judge.prefill_s = sim._context(Role.JUDGE, [1]) / model.prefill_per_s[Role.JUDGE]
    assert judge.prefill_s == 4
    sim._round(Round(2.0, early=False))
    assert sim.now == pytest.approx(8)
    assert sim.step.gen[0] == 8
    assert sim.slot_s["waiting"] == pytest.approx(1)


def measured_pivot(rules: RoundRules) -> Simulation:
    """Pivot at K = 2 on the costs tests/data/placements_cpu.json measured, at its ranks and --round-steps."""
    measured = json.loads(BENCH_JSON.read_text())
    model = C.CpuModel(C.load(), measured)
    config = planner.PlannerConfig(early_train=True, min_train_ranks=model.min_train_slots)
    return Simulation(model, C.cpu_workload(measured), measured["nproc"], "pivot", config=config,
                      rules=replace(rules, round_steps=int(measured["round_steps"])), max_staleness=2)


def test_rollout_engines_that_hold_twice_their_room_step_their_room_and_lose_nothing(monkeypatch):
    """The `rollout hold` what-if (bench/sim_whatif.py): on this machine's measured costs, pivot's rollout
    engine, alone in rollout beside a train rank at K = 2, holds more than its room (--max-seqs) but never
    steps more than that many at once, and every sample is still generated, judged and trained once."""
    sim = measured_pivot(RoundRules(rollout_hold=2.0))
    room, held, batches = sim.model.max_seqs[Role.ROLLOUT], [], []
    step_seconds = sim.model.engine_step_seconds

    def record(role, batch, context):
        batches.append((role, batch))
        return step_seconds(role, batch, context)

    monkeypatch.setattr(sim.model, "engine_step_seconds", record)
    dispatch = Simulation._dispatch

    def dispatched(sim, rnd):
        dispatch(sim, rnd)
        held.extend(len(s.running) for s in sim.slots if s.role == Role.ROLLOUT)

    monkeypatch.setattr(Simulation, "_dispatch", dispatched)
    result = sim.run(3, skip=1)
    assert room < max(held) <= 2 * room
    assert max(batch for role, batch in batches if role == Role.ROLLOUT) <= room
    assert [index for _, index, _ in result.trained] == list(range(len(result.trained)))


def test_the_what_ifs_run_on_what_the_bench_measured(tmp_path):
    """bench/sim_whatif.py --measured: its cases on this machine's costs, on the bench's ranks."""
    script, out = Path(__file__).resolve().parents[2] / "bench" / "sim_whatif.py", tmp_path / "whatif.json"
    run = subprocess.run([sys.executable, str(script), "--measured", str(BENCH_JSON), "--max-staleness", "2",
                          "--cases", "as calibrated,rollout hold", "--steps", "1", "--json", str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["gpus"] == json.loads(BENCH_JSON.read_text())["nproc"]
    assert set(report["cases"]["cpu"]) == {"as calibrated", "rollout hold"}
    assert all(case["pivot2_over_colocated0"] > 0 for case in report["cases"]["cpu"].values())
    wrong = subprocess.run([sys.executable, str(script), "--measured", str(BENCH_JSON), "--preset", "paper"],
                           capture_output=True, text=True)
    assert wrong.returncode != 0 and "--measured replays this machine's" in wrong.stderr
    figures = subprocess.run([sys.executable, str(script), "--measured", str(BENCH_JSON), "--cases", "free shifts"],
                             capture_output=True, text=True)
    assert figures.returncode != 0 and "pick cases that change the rounds alone" in figures.stderr


def test_an_update_made_during_the_rollout_is_published_at_the_round_it_is_made(monkeypatch):
    """On this machine's measured costs at K = 2, pivot's train slots make each update at a round's start
    while the next step rolls out, and it is published at that start too (book.publish_due, as the loop's
    _decide orders both). Every step is still trained once, in order."""
    made, published = {}, {}  # the round each update (by the step it trains) was made and published at
    due, publish = Simulation._update_due, Simulation._publish

    def update_due(sim):
        answer = due(sim)
        if answer:
            made.setdefault(sim.update.index, sim.rounds)
        return answer

    monkeypatch.setattr(Simulation, "_update_due", update_due)
    monkeypatch.setattr(Simulation, "_publish", lambda sim: (published.setdefault(sim.update.index, sim.rounds),
                                                             publish(sim)))
    result = measured_pivot(RoundRules()).run(3, skip=1)
    assert published and set(published) <= set(made)
    assert all(published[u] == made[u] for u in published)
    assert [index for _, index, _ in result.trained] == list(range(len(result.trained)))
