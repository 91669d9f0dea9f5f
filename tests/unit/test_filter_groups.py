"""--filter-groups (DAPO's dynamic sampling): groups whose G rewards are all equal leave the update, and
the step admits the next prompts of the data stream while it runs until it has --prompts-per-step
informative groups or has drawn --filter-groups-max-prompts. The pure tests drive rank 0's StepQueues
by hand, in many orders of completion; the slow ones are small runs of the built-in task."""
import json
import random
from types import SimpleNamespace

import pytest

from conftest import ROOT, SMALL_STEPS, metrics, same_run, samples, small_run
from roles.engine import Request
from roles.genrm import Verdict
from roles.rollout import Sample, sample_seed
from shifting.scheduler import Report, StepQueues, colocated_plan
from tasks.dataset import load_records, stream_prompts

G = 2
ARGS = SimpleNamespace(group_size=G, seed=0, temperature=1.0, max_response_tokens=8, workload="task")
# Each candidate prompt's rewards, by hand: informative when they differ.
REWARDS = [[1, 1], [0, 1], [0, 0], [1, 1], [1, 0], [0, 1]]
BATCH = [{"prompt": f"{p}+1=", "prompt_ids": [3, 4 + p], "reference": None, "rubric": None} for p in range(6)]


def run_step(queues: StepQueues, rewards, order: random.Random) -> dict:
    """Finishes queued requests one at a time, each drawn at random from those queued: a rollout becomes
    a sample with its judge request, a judge request a verdict with the hand-set reward. Returns the
    rollout requests in the order they were queued and every group handed to train on the way."""
    queued, handed = list(queues.queue["rollout"]), []
    while not queues.done():
        pool = [r for role in ("rollout", "genrm") for r in queues.queue[role]]
        request = pool[order.randrange(len(pool))]
        queues.queue[request.role].remove(request)
        report = Report(request.role)
        if request.role == "rollout":
            sample = Sample(*request.key, request.prompt_ids, [5], [-1.0], "stop", prompt=BATCH[request.key[0]]["prompt"])
            report.responses.append((sample, Request("genrm", request.key, [6], 8, 0.0)))
        else:
            p, g = request.key
            report.verdicts.append(Verdict(request.key, "", 1, 1, float(rewards[p][g]), False, True, 0))
        before = len(queues.queue["rollout"])
        queues.ingest([report], round_s=0.0)
        queued += list(queues.queue["rollout"])[before:]
        handed += [group[0].prompt_index for group in queues.hand_to_train()]
    return {"queued": queued, "handed": set(handed)}


@pytest.mark.parametrize("seed", range(20))
def test_the_step_draws_the_shortest_prefix_with_enough_informative_groups_in_any_order(seed):
    """Wanting 2 informative groups of REWARDS: prompts 0 to 4 (1 and 4 informative; 0, 2, 3 left out,
    each admitting the next prompt in stream order), never prompt 5, whatever order requests finish in."""
    queues = StepQueues(BATCH, step=3, args=ARGS, filter_groups=2)
    assert [r.key for r in queues.queue["rollout"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    seen = run_step(queues, REWARDS, random.Random(seed))
    # each replacement's G requests come together, in stream order, each with its own place's seed
    assert [r.key for r in seen["queued"]] == [(p, g) for p in range(5) for g in range(G)]
    assert [r.seed for r in seen["queued"]] == [sample_seed(0, 3, p, g) for p in range(5) for g in range(G)]
    assert sorted(queues.dropped) == [0, 2, 3]
    assert queues.ready_groups() == [1, 4] and seen["handed"] <= {1, 4}  # only informative groups reach train
    assert sorted(queues.samples) == [(p, g) for p in range(5) for g in range(G)]
    assert queues.judge_runs == queues.expected == 5 * G  # each admitted prompt's G samples judged once
    assert [s.dropped for s in queues.ordered_samples()] == [p in (0, 2, 3) for p in range(5) for _ in range(G)]


def test_at_the_cap_the_step_keeps_the_informative_groups_it_has():
    """Three prompts at most, one of them informative: all three drawn, two left out, one to train."""
    queues = StepQueues(BATCH[:3], step=0, args=ARGS, filter_groups=2)
    run_step(queues, REWARDS, random.Random(0))
    assert sorted(queues.dropped) == [0, 2] and queues.ready_groups() == [1] and queues.expected == 3 * G
    assert not queues.held


def test_without_the_filter_every_prompt_is_queued_and_none_left_out():
    queues = StepQueues(BATCH, step=0, args=ARGS)
    run_step(queues, REWARDS, random.Random(1))
    assert queues.dropped == [] and queues.ready_groups() == list(range(6))


def test_colocated_ranks_finish_judging_before_rolling_out_what_was_admitted():
    queues = StepQueues(BATCH, step=0, args=ARGS, filter_groups=2)
    for request in list(queues.queue["rollout"]):
        sample = Sample(*request.key, request.prompt_ids, [5], [-1.0], "stop")
        queues.ingest([Report("rollout", responses=[(sample, Request("genrm", request.key, [6], 8, 0.0))])], 0.0)
    queues.queue["rollout"].clear()
    judge = [queues.queue["genrm"].popleft() for _ in range(2)]  # prompt 0's group, all 1: left out
    queues.ingest([Report("genrm", verdicts=[Verdict(r.key, "", 1, 1, 1.0, False, True, 0) for r in judge])], 0.0)
    assert queues.dropped == [0] and [r.key for r in queues.queue["rollout"]] == [(2, 0), (2, 1)]
    rng = random.Random(0)
    assert colocated_plan(["genrm"] * 2, queues, rng)[0] == ["genrm"] * 2  # prompt 1 still to judge
    queues.queue["genrm"].clear()
    assert colocated_plan(["genrm"] * 2, queues, rng)[0] == ["rollout"] * 2


def step_rows(out):
    """samples.jsonl by step: each step's rows in (prompt, sample) order."""
    rows = {}
    for row in samples(out):
        rows.setdefault(row["step"], []).append(row)
    return rows


@pytest.mark.slow
def test_a_run_trains_only_informative_groups_and_its_counts_add_up(uninterrupted):
    """Pivot (early training, the planner) wanting 4 informative groups of 4, at most 16 prompts a step:
    every admitted prompt yields G samples judged once, the update trains exactly the groups of unequal
    rewards (its response tokens are theirs), and the prompts drawn are the data stream's, in order."""
    out, _ = uninterrupted("pivot-filter")
    records = [r for r in metrics(out) if "reward_mean" in r]
    rows = step_rows(out)
    assert [r["step"] for r in records] == list(range(SMALL_STEPS))
    drawn_prompts = []
    for r in records:
        kept, groups = r["filter_groups"], rows[r["step"]]
        assert kept["prompts_drawn"] == kept["dropped"] + kept["trained"] <= 16
        assert kept["trained"] == 4 or (kept["capped"] and kept["prompts_drawn"] == 16 and kept["trained"] < 4)
        assert r["samples"] == r["genrm_requests"] == len(groups) == 4 * kept["prompts_drawn"]
        groups = [groups[i:i + 4] for i in range(0, len(groups), 4)]
        for group in groups:
            assert len({row["prompt"] for row in group}) == 1 and len({row["trained"] for row in group}) == 1
            assert group[0]["trained"] == (len({row["reward"] for row in group}) > 1)
        assert sum(not g[0]["trained"] for g in groups) == kept["dropped"]
        assert r["tokens"] == sum(row["response_tokens"] for g in groups for row in g if row["trained"])
        assert r["early_trained_groups"] <= kept["trained"]
        drawn_prompts += [g[0]["prompt"] for g in groups]
    train_set = load_records(str(ROOT / "tasks/data/arith_train.jsonl"))  # all of it fits the default lengths
    assert drawn_prompts == [train_set[i]["prompt"] for i in stream_prompts(len(train_set), 0, len(drawn_prompts), 0)]
    assert sum(r["filter_groups"]["dropped"] for r in records) > 0  # the filter had something to do
    position = json.loads((out / f"checkpoints/step-{SMALL_STEPS:06d}/meta.json").read_text())["data_position"]
    assert position == len(drawn_prompts)


@pytest.mark.slow
def test_a_filtered_run_stopped_and_resumed_draws_as_one_in_another_placement(uninterrupted, tmp_path):
    """Colocated, stopped after its first step and run again: the same prompts drawn, the same samples
    left out and trained, the same rewards as the pivot run (its state to float rounding: pivot trains
    groups early); what a step draws depends on neither the placement nor the order groups finish in."""
    cut = tmp_path / "cut"
    small_run(cut, "colocated-filter", steps=1)
    small_run(cut, "colocated-filter")
    pivot = uninterrupted("pivot-filter")[0]
    same_run(pivot, cut, exact=False)
    for key in ("filter_groups", "eval_accuracy_avg@3"):  # avg@3: each answer seeded, wherever it is sampled
        assert [r.get(key) for r in metrics(cut)] == [r.get(key) for r in metrics(pivot)], key


@pytest.mark.slow
def test_a_step_with_no_informative_group_at_its_cap_trains_nothing(tmp_path):
    """Every reward 0 (the exact-match source alone, against references no answer gives): the step draws
    its 3 prompts, leaves all 3 groups out, says it is capped, and the weights stay the starting ones."""
    from safetensors.torch import load_file

    from conftest import POLICY, torchrun
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "reference": "never"}) + "\n" for a in range(1, 9)))
    out = tmp_path / "run"
    torchrun(ROOT / "pivot_train.py", "--data", data, "--eval-split", 0.25, "--eval-every", 100, "--steps", 1,
             "--prompts-per-step", 2, "--group-size", 2, "--filter-groups", "--filter-groups-max-prompts", 3,
             "--reward", "exact=1", "--out", out)
    step = metrics(out)[0]
    assert step["filter_groups"] == {"prompts_drawn": 3, "dropped": 3, "trained": 0, "capped": True}
    assert step["samples"] == 6 and step["tokens"] == 0 and step["skipped_updates"] == 0
    assert all(not row["trained"] for row in samples(out))
    start, end = load_file(POLICY / "model.safetensors"), load_file(out / "model/model.safetensors")
    assert sorted(start) == sorted(end) and all(end[name].equal(t) for name, t in start.items())
