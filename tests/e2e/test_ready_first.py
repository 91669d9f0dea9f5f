"""--updates ready at --max-staleness 2 (the default there): small runs of the long-tail workload on every
placement, whose updates each take the groups judged first within the bound. Whatever the order groups
finish in, every prompt drawn has its G responses judged once and trained once, in one update, within K
versions of the weights that sampled each of its tokens; what a step's end leaves out is trained in the
update after, and a run killed mid-pipeline resumes with the same guarantees."""
import collections
import json

import pytest

from conftest import BENCH_JSON, metrics, restarted, samples, small_run
from sim.replay import replay_run

STEPS, PROMPTS, G, K = 6, 8, 4, 2


def updates(out):
    return [r for r in metrics(out) if "reward_mean" in r]


def holds_the_bound_group_by_group(out) -> list[dict]:
    """Every group of every step trained once, whole, in one update, each of its tokens sampled at most K
    versions before that update (each later stretch by the same or newer weights), the record's counts
    those of the samples it trained; the groups a step's end left out are those the next update took from
    an earlier step. Returns the updates' records."""
    records, logged = updates(out), samples(out)
    assert [r["step"] for r in records] == list(range(STEPS))
    assert sum(r["judge_requests"] for r in records) == PROMPTS * G * STEPS  # each judged once
    assert collections.Counter(tuple(s["group"]) for s in logged) == \
        {(step, p): G for step in range(STEPS) for p in range(PROMPTS)}
    assert all(len({s["step"] for s in logged if tuple(s["group"]) == group}) == 1 for group in
               {tuple(s["group"]) for s in logged})  # a group trains in one update
    for u, r in enumerate(records):
        trained = [s for s in logged if s["step"] == u]
        assert r["samples"] == len(trained) and sum(r["staleness"].values()) == len(trained)
        assert all(0 <= int(k) <= K for k in r["staleness"])
        tokens = collections.Counter()
        for s in trained:
            firsts, versions = [f for f, _ in s["versions"]], [v for _, v in s["versions"]]
            assert firsts[0] == 0 and firsts == sorted(set(firsts)) and versions == sorted(set(versions))
            assert u - versions[0] <= K
            for first, end, version in zip(firsts, firsts[1:] + [s["response_tokens"]], versions):
                tokens[str(u - version)] += end - first
        assert dict(tokens) == r["staleness_tokens"]
        assert r["earlier_step_groups"] == len({tuple(s["group"]) for s in trained if s["group"][0] < u})
    assert sum(r["spilled_groups"] for r in records) == sum(r["earlier_step_groups"] for r in records)
    return records


@pytest.mark.parametrize("placement", ["colocated-ready", "pivot-ready", "forced-ready", "disaggregated-ready",
                                       "pivot-tp2-ready"])
def test_updates_take_the_groups_judged_first_within_the_bound(tmp_path, placement):
    """Its rounds, replayed through the simulator's book (sim/replay.py), give the orders the loop gave,
    the steps' ends and what they leave to the next among them: both follow book.Book.may_end and spill. At
    --engine-tp 2 (pivot-tp2, four ranks) the rounds are those of two slots, which the simulator replays as
    its slots."""
    out = tmp_path / "run"
    small_run(out, placement, steps=STEPS)
    records = holds_the_bound_group_by_group(out)
    assert replay_run(out, json.loads(BENCH_JSON.read_text())) == []
    if placement == "forced-ready":  # a seeded schedule: the same rounds every run, some steps end with groups out
        assert sum(r["spilled_groups"] for r in records) > 0


def test_a_rank_killed_mid_pipeline_resumes_with_every_group_trained_once(tmp_path):
    """A checkpoint every 2 updates (each ends its step whole: nothing left out crosses it); rank 0 is killed
    at its 65th rollout engine step, in update 2's rounds, after steps whose ends left groups to the next.
    The run resumes from the checkpoint after update 1, and every group is still judged once and trained
    once, within the bound."""
    out = tmp_path / "run"
    proc = small_run(out, "forced-ready-every2", steps=STEPS, restarts=1, env={"PIVOT_KILL": "0:rollout:65"})
    assert "resuming from" in restarted(proc) and "step-000002" in restarted(proc)
    records = holds_the_bound_group_by_group(out)
    assert sum(r["spilled_groups"] for r in records) > 0
