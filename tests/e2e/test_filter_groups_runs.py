"""--filter-groups (DAPO's dynamic sampling) in small runs of the built-in task: each step trains exactly
its informative groups, draws the data stream's prompts in order, and draws the same in any placement and
across a restart (the step's queues by hand: tests/unit/test_filter_groups.py)."""
import json

from conftest import ROOT, SMALL_STEPS, metrics, same_run, samples, small_run
from tasks.dataset import load_records, stream_prompts


def step_rows(out):
    """samples.jsonl by step: each step's rows in (prompt, sample) order."""
    rows = {}
    for row in samples(out):
        rows.setdefault(row["step"], []).append(row)
    return rows


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
        assert r["samples"] == r["judge_requests"] == len(groups) == 4 * kept["prompts_drawn"]
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
