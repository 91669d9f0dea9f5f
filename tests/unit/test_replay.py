"""The simulator's book against the loop's: each placement's recorded run on this machine
(bench/placements.py's JSON, tests/data/placements_cpu.json: 4 ranks, K = 0 and 2, its rounds from
pivot_train.py --trace-rounds) replayed through the simulator (sim/replay.py) gives the orders the loop's
rank 0 gave, round by round: the samples each rank takes, the groups handed to train, when the update is
made and published, timed rounds, the step's end and what it carries."""
import copy
import json

import pytest

from conftest import BENCH_JSON
from sim.replay import replay_bench

RUNS = ("colocated@0", "disaggregated@0", "pivot@0", "colocated@2", "disaggregated@2", "pivot@2")


@pytest.fixture(scope="module")
def measured():
    return json.loads(BENCH_JSON.read_text())


@pytest.fixture(scope="module")
def replayed(measured):
    return replay_bench(measured)


def test_the_recording_holds_every_placement_at_k0_and_k2(measured):
    assert sorted(measured["rounds"]) == sorted(RUNS)
    for name in RUNS:
        k = int(name.split("@")[1])
        steps = measured["rounds"][name]  # the K steps of the pipeline's drain roll nothing out
        assert [line["step"] for line in steps] == list(range(measured["steps"] + k))
        for line in steps:  # each step's rounds end with the one it ends in, and the requests it carries
            orders = [rec for rec in line["rounds"] if "carry" not in rec]
            assert [rec["done"] for rec in orders] == [False] * (len(orders) - 1) + [True]
    for name in ("disaggregated@2", "pivot@2"):  # the updates were published during the steps, which began the next
        assert any(line["carried"] for line in measured["rounds"][name])
        assert any(rec.get("publish") for line in measured["rounds"][name] for rec in line["rounds"])


@pytest.mark.parametrize("name", RUNS)
def test_the_simulator_orders_what_the_loop_ordered(replayed, name):
    assert replayed[name] == []


@pytest.mark.parametrize("name, change", [("colocated@0", "work"), ("pivot@0", "handed"), ("pivot@2", "publish"),
                                          ("disaggregated@2", "update")])
def test_an_order_the_simulator_would_not_give_is_found(measured, name, change):
    """One order of the recording changed, as a rule that differs between the loop and the simulator would
    change it: the replay reports it."""
    changed = copy.deepcopy(measured)
    orders = [rec for line in changed["rounds"][name] for rec in line["rounds"] if "work" in rec]
    if change == "work":  # two ranks' shares swapped
        rec = next(rec for rec in orders if sum(bool(w) for w in rec["work"]) > 1)
        first, second = [rank for rank, work in enumerate(rec["work"]) if work][:2]
        rec["work"][first], rec["work"][second] = rec["work"][second], rec["work"][first]
    elif change == "handed":  # the groups handed to train in another order
        next(rec for rec in orders if len(rec["handed"]) > 1)["handed"].reverse()
    else:  # the update left unpublished, or unmade, in the round it came in
        rounds = [rec for rec in orders if rec[change]]
        assert rounds, f"{name} never orders {change}"
        rounds[0][change] = False
    changed["rounds"] = {name: changed["rounds"][name]}
    found = replay_bench(changed)[name]
    assert found and "simulated" in found[0] and "recorded" in found[0]
