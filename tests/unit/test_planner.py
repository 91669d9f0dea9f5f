"""The planner's decisions on hand-made step states: pure, milliseconds."""
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from planner import (ROLES, EngineSpeed, LengthEstimate, LinearFit, LoopPlanner, Move, PlannerConfig, Rank,
                     Speeds, Work, _overflows, apply_moves, finish_seconds, first_empty_seconds, parse_split, plan,
                     step_work, update_seconds)
from shifting import book

SPEEDS = Speeds(rollout=EngineSpeed(step_s=0.02, per_seq_s=2e-4, prefill_per_s=2e4, max_seqs=64),
                judge=EngineSpeed(step_s=0.05, per_seq_s=4e-4, prefill_per_s=1e4, max_seqs=64),
                train_per_s=5e3)


def costs(seconds: float) -> dict:
    return {(a, b): seconds for a in ROLES for b in ROLES if a != b}


# A step just begun: all rollout, nothing to judge yet.
START = Work(rollout_seqs=512, rollout_tokens=512 * 2000, rollout_longest=16000, rollout_prefill=512 * 300,
             critique_tokens=500, judge_prompt_tokens=2300, train_tokens=512 * 2300)
# Rollout's tail: 30 sequences, the judge far behind.
TAIL = Work(rollout_seqs=30, rollout_tokens=30 * 500, rollout_longest=1000, judge_seqs=3000,
            judge_tokens=3000 * 500, judge_prefill=3000 * 1500, critique_tokens=500, judge_prompt_tokens=1500,
            train_tokens=1e6)


def ranks(*roles, tokens=0) -> list[Rank]:
    return [Rank(role, tokens) for role in roles]


def test_no_move_when_the_saving_is_below_the_cost():
    assert plan(ranks(*["rollout"] * 7, "judge", tokens=100), TAIL, SPEEDS, costs(1e4)) == []
    moves = plan(ranks(*["rollout"] * 7, "judge", tokens=100), TAIL, SPEEDS, costs(1.0))
    assert moves and all(m.src == "rollout" and m.dst == "judge" for m in moves)


def test_a_move_pays_its_cost_with_margin():
    now = ranks(*["rollout"] * 7, "judge", tokens=100)
    config = PlannerConfig(margin=0.5)
    moved = []
    for c in (0.5, 5.0, 50.0):
        moves = plan(now, TAIL, SPEEDS, costs(c), config)
        counts = {role: sum(r.role == role for r in now) for role in ROLES}
        after = {role: sum(r == role for r in apply_moves([r.role for r in now], moves)) for role in ROLES}
        saved = finish_seconds(TAIL, counts, SPEEDS, costs(c)) - finish_seconds(TAIL, after, SPEEDS, costs(c))
        if moves:
            assert saved > (1 + config.margin) * c
        moved.append(len(moves))
    # cheap moves are taken, fewer as they get dearer, none once no saving pays for them
    assert moved[0] > 0 and moved[0] >= moved[1] >= moved[2] == 0


def test_tail_frees_rollout_ranks_for_the_judge_and_keeps_one():
    now = ranks(*["rollout"] * 7, "judge", tokens=100)
    roles = apply_moves(["rollout"] * 7 + ["judge"], plan(now, TAIL, SPEEDS, costs(1.0)))
    assert roles.count("judge") >= 4 and roles.count("rollout") >= 1


def test_judge_ranks_without_work_go_to_a_rollout_bottleneck():
    moves = plan(ranks("rollout", *["judge"] * 7), START, SPEEDS, costs(1.0))
    assert moves and all(m.src == "judge" and m.dst == "rollout" for m in moves)


def test_migration_prefill_counts_as_cost():
    cheap = plan(ranks(*["rollout"] * 7, "judge", tokens=100), TAIL, SPEEDS, costs(1.0))
    # every rollout rank holds sequences whose prefill alone costs more than the move could save
    dear = plan(ranks(*["rollout"] * 7, "judge", tokens=10 ** 9), TAIL, SPEEDS, costs(1.0))
    assert cheap and dear == []


def test_no_move_leaves_rollout_more_sequences_than_its_ranks_run():
    # TAIL's 30 sequences on 7 rollout ranks: with room for 64 each, six ranks go to the judge; with room
    # for 8, the 30 need four ranks, so no more than three go (the rest would wait at rank 0 for rounds)
    now = ranks(*["rollout"] * 7, "judge", tokens=100)
    roomy = apply_moves([r.role for r in now], plan(now, TAIL, SPEEDS, costs(1.0)))
    small = replace(SPEEDS, rollout=replace(SPEEDS.rollout, max_seqs=8))
    tight = apply_moves([r.role for r in now], plan(now, TAIL, small, costs(1.0)))
    assert roomy.count("rollout") == 1 and tight.count("rollout") == 4
    # with prompts already waiting for rollout the queue is there either way, and where the step may end
    # with groups still out (ready-first) a sequence that waits holds no update: the rule does not apply
    leaving = ranks("rollout", tokens=100)
    assert _overflows(TAIL, leaving, 3, 8) and not _overflows(TAIL, ranks("rollout"), 3, 8)
    assert not _overflows(replace(TAIL, rollout_prefill=300), leaving, 3, 8)
    assert not _overflows(replace(TAIL, spill=True), leaving, 3, 8)


def test_a_judge_without_a_rank_waits_where_rollout_cannot_spare_one():
    # two rollout ranks of 64 sequences each, a first response to judge, no prompt waiting: the judge's
    # first rank would leave 127 sequences on one engine of 64, so it waits for the rollout ranks
    full = Work(rollout_seqs=127, rollout_tokens=127 * 20, rollout_longest=40, judge_seqs=1, judge_tokens=50,
                judge_prefill=60, critique_tokens=50, judge_prompt_tokens=60, train_tokens=128 * 60)
    now = ranks("rollout", "rollout", tokens=500)
    assert plan(now, full, SPEEDS, costs(1e9)) == []
    # once the rest fit on one engine, it gets one, cost or not
    fewer = replace(full, rollout_seqs=60, rollout_tokens=60 * 20)
    assert plan(now, fewer, SPEEDS, costs(1e9)) == [Move(0, "rollout", "judge")]


def test_the_cheapest_rank_to_migrate_moves_first():
    now = [Rank("rollout", t) for t in (900, 100, 500, 700, 300, 800, 600)] + [Rank("judge")]
    moves = plan(now, TAIL, SPEEDS, costs(1.0))
    moved = [now[m.rank].in_flight_tokens for m in moves]
    assert moved == sorted(moved) and moved[0] == 100


def test_a_judge_backlog_gets_a_rank_whatever_the_cost():
    moves = plan(ranks(*["rollout"] * 4, tokens=100), TAIL, SPEEDS, costs(1e9))
    assert moves == [Move(0, "rollout", "judge")]


def test_rollout_ranks_join_the_judge_once_rollout_ends():
    # rollout done, responses waiting: the three rollout ranks would otherwise idle until the update
    waiting = Work(judge_seqs=300, judge_tokens=300 * 500, judge_longest=4000, judge_prefill=200 * 1500,
                   critique_tokens=500, judge_prompt_tokens=1500, train_tokens=1e6)
    now = [Rank("rollout", 0, since_shift_s=0.0)] + ranks("rollout", "rollout", "judge")
    assert apply_moves([r.role for r in now], plan(now, waiting, SPEEDS, costs(1e9))) == ["judge"] * 4
    # nothing waits (every response is being judged): they stay
    judging = Work(judge_seqs=3, judge_tokens=1500, judge_longest=4000, critique_tokens=500, train_tokens=1e6)
    assert plan(now, judging, SPEEDS, costs(1e9)) == []


def test_idle_rollout_ranks_judge_waiting_responses_whatever_the_cost():
    # rollout's last 2 sequences run on ranks 0 and 1; ranks 2-6 have nothing to run and no prompt waits;
    # 100 responses wait for the judge: two engines' worth (64 each), so two idle ranks go, cost or not
    work = Work(rollout_seqs=2, rollout_tokens=2 * 5000, rollout_longest=8000, judge_seqs=164,
                judge_tokens=164 * 500, judge_longest=4000, judge_prefill=100 * 1500, critique_tokens=500,
                judge_prompt_tokens=1500, train_tokens=1e6)
    now = [Rank("rollout", 900), Rank("rollout", 800)] + ranks(*["rollout"] * 5) + [Rank("judge", 5000)]
    assert plan(now, work, SPEEDS, costs(1e9)) == [Move(2, "rollout", "judge"), Move(3, "rollout", "judge")]
    # a prompt still waiting for a rollout engine: the idle ranks are rollout's to use
    assert plan(now, replace(work, rollout_prefill=300), SPEEDS, costs(1e9)) == []
    # nothing waits for the judge (every response is being judged): they stay
    assert plan(now, replace(work, judge_prefill=0.0), SPEEDS, costs(1e9)) == []


def test_a_rank_that_just_moved_stays():
    now = [Rank("rollout", 100, since_shift_s=1.0) for _ in range(7)] + [Rank("judge")]
    assert plan(now, TAIL, SPEEDS, costs(1.0), PlannerConfig(dwell=2.0)) == []


def test_steady_workload_settles_without_oscillation():
    roles, moves_per_call = ["rollout"] * 4 + ["judge"] * 4, []
    since = [math.inf] * 8
    for _ in range(50):
        moves = plan([Rank(r, 100, s) for r, s in zip(roles, since)], TAIL, SPEEDS, costs(2.0))
        roles = apply_moves(roles, moves)
        since = [0.0 if any(m.rank == i for m in moves) else s + 1.0 for i, s in enumerate(since)]
        moves_per_call.append(len(moves))
    # it rebalances first (the judge is far behind), then stays put
    assert moves_per_call[0] > 0 and sum(moves_per_call[5:]) == 0 and sum(moves_per_call) <= 8


def test_early_training_only_with_complete_groups_and_a_large_enough_group():
    # one long critique left: seven judge ranks idle while it runs
    work = Work(judge_seqs=1, judge_tokens=2e4, judge_longest=2e4, train_ready=5e6, train_tokens=6e6)
    now = ranks(*["judge"] * 8)
    assert plan(now, work, SPEEDS, costs(1.0)) == []  # early training not allowed
    moves = plan(now, work, SPEEDS, costs(1.0), PlannerConfig(early_train=True, min_train_ranks=4))
    assert moves and {m.dst for m in moves} == {"train"} and len(moves) >= 4
    assert plan(now, Work(judge_seqs=1, judge_tokens=2e4, judge_longest=2e4, train_tokens=6e6), SPEEDS, costs(1.0),
                PlannerConfig(early_train=True)) == []  # no complete group yet


def test_early_training_pays_for_the_reshard_it_forces():
    # As in the test above, seven judge ranks idle beside one long critique; the early train group is
    # made anew with all eight at the update, and every rank waits for that reshard.
    work = Work(judge_seqs=1, judge_tokens=2e4, judge_longest=2e4, train_ready=5e6, train_tokens=6e6)
    config = PlannerConfig(early_train=True, min_train_ranks=4)
    cheap, dear = {**costs(1.0), ("train", "train"): 1.0}, {**costs(1.0), ("train", "train"): 1e4}
    assert plan(ranks(*["judge"] * 8), work, SPEEDS, cheap, config)
    assert plan(ranks(*["judge"] * 8), work, SPEEDS, dear, config) == []
    counts = {"judge": 4, "train": 4}
    assert finish_seconds(work, counts, SPEEDS, dear, True) - finish_seconds(work, counts, SPEEDS, cheap, True) \
        == pytest.approx(1e4 - 1.0)


def test_growing_a_train_group_pays_for_the_save_every_rank_waits_for():
    # One rank trains early beside seven judge ranks that idle by a long critique, with hours of training
    # ready: more train ranks pay, unless regrouping (the state saved, every rank waiting) costs more.
    work = Work(judge_seqs=1, judge_tokens=2e4, judge_longest=2e4, train_ready=5e7, train_tokens=6e7)
    config = PlannerConfig(early_train=True, min_train_ranks=1)
    held = ranks(*["judge"] * 7, "train")
    assert {m.dst for m in plan(held, work, SPEEDS, {**costs(1.0), ("train", "train"): 1.0}, config)} == {"train"}
    assert plan(held, work, SPEEDS, {**costs(1.0), ("train", "train"): 1e3}, config) == []


def test_an_earlier_steps_update_made_by_the_train_ranks_costs_the_step_nothing_at_its_end():
    # --max-staleness > 0: the update's groups (an earlier step's) are all judged at the step's start.
    # Two train ranks that are through them before the last critique make the update there: the step
    # ends with its judging, where a step's own update (update_early False) still costs every rank the
    # move to train and the reshard into one group at the end.
    work = Work(rollout_seqs=30, rollout_tokens=30 * 500, rollout_longest=1000, critique_tokens=500,
                judge_prompt_tokens=1500, train_ready=1e5, train_tokens=1e5, update_early=True)
    counts = {"rollout": 6, "train": 2}
    chain = finish_seconds(replace(work, train_ready=0.0, train_tokens=0.0), {"rollout": 6, "judge": 0}, SPEEDS,
                           costs(1.0))
    assert finish_seconds(work, counts, SPEEDS, costs(1.0), True) == pytest.approx(chain)
    # six ranks move to train at 1 s each, the work spread over eight
    assert finish_seconds(replace(work, update_early=False), counts, SPEEDS, costs(1.0), True) == \
        pytest.approx(chain + 6 * 1.0 / 8)
    # Once made (nothing left to train) nothing is owed at the end, with no train rank left too.
    done = replace(work, train_ready=0.0, train_tokens=0.0)
    assert finish_seconds(done, {"rollout": 8}, SPEEDS, costs(1.0), True) == pytest.approx(
        finish_seconds(done, {"rollout": 8}, SPEEDS, costs(0.0), True))


def test_a_step_that_may_spill_weighs_its_update_not_its_longest_critique():
    """--updates ready at K >= 2 (Work.spill): the step may end with groups still out, which go on in the
    next step, and the update's publish begins that step, whose rollout fills this one's tail. So with one
    rank writing the last long critique (about 1,000 s alone) and one training the update (200 s alone),
    the two idle judge ranks go to train, where the update is published three times sooner. Step-locked,
    the step lasts until that critique is written, long after the train rank is through: they stay."""
    work = Work(judge_seqs=1, judge_tokens=2e4, judge_longest=2e4, train_ready=1e6, train_tokens=1e6,
                update_early=True, spill=True)
    config = PlannerConfig(early_train=True)
    held = [Rank("judge", 20000), Rank("judge", 0), Rank("judge", 0), Rank("train")]
    shifts = {**costs(1.0), ("train", "train"): 1.0}
    assert finish_seconds(work, {"judge": 1, "idle": 2, "train": 1}, SPEEDS, shifts, True) == pytest.approx(200)
    assert plan(held, work, SPEEDS, shifts, config) == [Move(1, "judge", "train"), Move(2, "judge", "train")]
    assert plan(held, replace(work, spill=False), SPEEDS, shifts, config) == []


def test_a_step_that_may_spill_weighs_its_rollouts_bulk_not_its_longest_responses():
    """--updates ready at K >= 2: the step may end with its longest responses still rolling out
    (book.bulk_share: at groups of 16, once 95.8% of the samples are generated), so the rollout's tail the
    planner weighs is the response at that share of the lengths seen, none once every sequence still
    rolling is past it. Twelve sequences in a long tail on six rollout ranks, with the update to train:
    five of the six go to train and their sequences go on on the sixth, where a step-locked step, which
    lasts until its longest response is judged, moves one."""
    lengths = LengthEstimate([1000] * 96 + [16000] * 4, 16000)
    assert book.bulk_share(16) == pytest.approx(0.5 ** (1 / 16)) and lengths.longest(900, book.bulk_share(16)) == 100
    assert lengths.longest(1200, book.bulk_share(16)) == 0 and lengths.longest(900) == 15100

    def work(spill: bool) -> Work:
        return step_work(rolling=[900] * 8 + [2000] * 4, judging=[], rollout_prefill=0, judge_waiting=0,
                         judge_prefill=0, prompt_tokens=100, judge_template_tokens=50, train_ready=4e6,
                         train_generated=4e6, train_coming=0, early_train=True, update_early=True, lengths=lengths,
                         critiques=LengthEstimate([300] * 100, 2000), spill=spill, group_size=16)

    assert work(True).rollout_longest == 100 and work(False).rollout_longest == 15100
    held, config = [Rank("rollout", 4000)] * 6 + [Rank("train")] * 2, PlannerConfig(early_train=True)
    shifts = {(a, b): 1.0 for a in ROLES for b in ROLES}
    assert [m.dst for m in plan(held, work(True), SPEEDS, shifts, config)] == ["train"] * 5
    assert [m.dst for m in plan(held, work(False), SPEEDS, shifts, config)] == ["train"]


def test_the_train_ranks_make_the_update_alone_where_every_rank_would_not_be_faster():
    """Once the step's rounds are over, with 8 s of training left: the two train ranks of four alone, or
    every rank (the others shifting into train while the train ranks reshard, all at once, then the
    training over four)."""
    roles = ["train", "train", "judge", "rollout"]
    shifts = {("judge", "train"): 1.0, ("rollout", "train"): 0.5, ("train", "train"): 1.5}
    assert update_seconds(0.0, roles, shifts) == (0.0, True)  # trained through: nothing to move for
    assert update_seconds(8.0, roles, shifts) == (pytest.approx(1.5 + 8 / 4), False)  # alone 4 s
    assert update_seconds(4.0, roles, shifts) == (2.0, True)  # every rank 1.5 + 1 s
    assert update_seconds(8.0, roles, {**shifts, ("train", "train"): 3.0}) == (4.0, True)  # a dear reshard
    assert update_seconds(8.0, ["judge"] * 4, shifts) == (pytest.approx(1.0 + 2.0), False)  # no train rank
    assert update_seconds(8.0, ["train"] * 4, shifts) == (2.0, True)  # every rank trains already


def test_an_empty_judge_rank_in_the_judges_tail_adds_nothing_to_the_judge():
    # Rollout is over and no response waits: one rank writes the last 64 critiques, its neighbour has run
    # empty. Moving the empty one cannot slow the judge, so with judged groups ready it trains; counted as
    # a judge rank it would seem to halve the judge's speed (30 s left instead of 20), and it stayed idle.
    # When the critiques left are short and regrouping at the update dear, it stays.
    work = Work(judge_seqs=64, judge_tokens=64 * 400, judge_longest=400, train_ready=1e4, train_tokens=1e4)
    config = PlannerConfig(early_train=True)
    held = [Rank("judge", 64 * 900), Rank("judge", 0)]
    assert plan(held, work, SPEEDS, costs(0.1), config) == [Move(1, "judge", "train")]
    assert finish_seconds(work, {"judge": 2}, SPEEDS, costs(0.1), True) < \
        finish_seconds(work, {"judge": 1, "train": 1}, SPEEDS, costs(0.1), True)
    short = replace(work, judge_tokens=64 * 5, judge_longest=8)
    assert plan(held, short, SPEEDS, {**costs(0.1), ("train", "train"): 1.0}, config) == []


def test_an_earlier_steps_update_holds_a_train_rank_until_it_is_trained():
    # --max-staleness K > 0: the update's groups are an earlier step's, all judged as the step starts.
    # Training them is work the train role can do now: the sooner it is made, the sooner it is published
    # and the next step begins. So train gets a rank as the step starts, from rollout's two (the one with
    # the fewest tokens in flight), keeps it while groups are left, even when the judge has responses
    # and no rank (they wait for the rollout rank, which joins the judge as rollout ends), and gives it
    # to rollout only where no other rank can roll out. At K = 0 nothing of this applies.
    config = PlannerConfig(early_train=True)
    start = Work(rollout_seqs=128, rollout_tokens=128 * 50, rollout_longest=96, rollout_prefill=128 * 20,
                 train_ready=4e3, train_tokens=4e3, update_early=True)
    assert plan([Rank("rollout", 10), Rank("rollout", 0)], start, SPEEDS, costs(0.1), config) == \
        [Move(1, "rollout", "train")]
    assert plan([Rank("rollout", 10), Rank("rollout", 0)], replace(start, update_early=False), SPEEDS,
                costs(0.1), config) == []
    streaming = replace(start, judge_seqs=8, judge_tokens=8 * 30, judge_longest=30, judge_prefill=8 * 60)
    assert plan([Rank("rollout", 900), Rank("train")], streaming, SPEEDS, costs(0.1), config) == []
    assert plan([Rank("judge", 900), Rank("train")], streaming, SPEEDS, costs(0.1), config) == \
        [Move(1, "train", "rollout")]
    trained = replace(streaming, train_ready=0.0, train_tokens=0.0)
    assert Move(1, "train", "judge") in plan([Rank("rollout", 900), Rank("train")], trained, SPEEDS, costs(0.1),
                                             config)
    # A train group of two: train gets two ranks, or none
    two = PlannerConfig(early_train=True, min_train_ranks=2)
    assert plan([Rank("rollout", 10), Rank("rollout", 0), Rank("rollout", 5)], start, SPEEDS, costs(0.1), two) == \
        [Move(1, "rollout", "train"), Move(2, "rollout", "train")]
    assert plan([Rank("rollout", 10), Rank("judge", 0)], replace(streaming, judge_seqs=0), SPEEDS, costs(0.1),
                two) == []


def test_train_ranks_are_credited_only_with_judged_groups():
    # One long critique holds the judge for minutes; one group is judged (1 s of training for one rank)
    # and the rest of the update is still to come. Train ranks would finish that group and wait: no
    # move pays, where crediting them with groups still being judged sent seven ranks to train.
    work = Work(judge_seqs=64, judge_tokens=64 * 4000, judge_longest=16000, judge_prefill=64 * 2000,
                critique_tokens=4000, train_ready=SPEEDS.train_per_s, train_tokens=1e8)
    assert plan(ranks(*["judge"] * 8), work, SPEEDS, costs(1.0), PlannerConfig(early_train=True)) == []


works = st.builds(
    Work, rollout_seqs=st.integers(0, 300), rollout_tokens=st.floats(0, 1e6), rollout_longest=st.floats(0, 2e4),
    rollout_prefill=st.floats(0, 1e5), judge_seqs=st.integers(0, 300), judge_tokens=st.floats(0, 1e5),
    judge_longest=st.floats(0, 4e3), judge_prefill=st.floats(0, 1e6), critique_tokens=st.floats(0, 4e3),
    judge_prompt_tokens=st.floats(0, 2e4),
    train_ready=st.floats(0, 1e6), train_tokens=st.floats(0, 1e7))
assignments = st.lists(st.tuples(st.sampled_from(ROLES), st.integers(0, 10 ** 5), st.floats(0, 100)),
                       min_size=2, max_size=32)


@settings(max_examples=300, deadline=None)
@given(work=works, held=assignments, cost=st.floats(0.01, 100), early=st.booleans())
def test_properties(work, held, cost, early):
    now = [Rank(role, tokens, since) for role, tokens, since in held]
    config = PlannerConfig(early_train=early, min_train_ranks=2)
    moves = plan(now, work, SPEEDS, costs(cost), config)
    assert moves == plan(now, work, SPEEDS, costs(cost), config)  # deterministic
    roles = apply_moves([r.role for r in now], moves)
    assert len({m.rank for m in moves}) == len(moves)  # a rank moves at most once per plan
    if work.rollout_seqs:
        assert "rollout" in roles
    if work.judge_seqs:  # ... unless its first rank would leave rollout more than its engines run
        assert "judge" in roles or _overflows(work, [r for r in now if r.role == "rollout"], roles.count("rollout") - 1,
                                              SPEEDS.rollout.max_seqs)
    if early and "train" in roles and any(m.dst == "train" for m in moves):
        assert roles.count("train") >= config.min_train_ranks


def test_linear_fit_follows_measurements_and_starts_from_its_prior():
    fit = LinearFit(0.03, 0.002)
    assert fit.fit() == pytest.approx((0.03, 0.002))
    for batch in (1, 8, 32, 64) * 20:
        fit.observe(batch, 0.02 + 0.001 * batch)
    assert fit.fit() == pytest.approx((0.02, 0.001), rel=0.05)
    for _ in range(100):  # one batch size only: still defined
        fit.observe(16, 0.5)
    fixed, per = fit.fit()
    assert fixed + 16 * per == pytest.approx(0.5, rel=0.05)
    one = LinearFit(0.0, 0.0, lo=1, hi=1, prior_weight=1e-6)  # an engine of one sequence: no slope to fit
    one.observe(1, 0.25)
    assert one.fit() == pytest.approx((0.25, 0.0), rel=1e-4)


def test_length_estimate():
    est = LengthEstimate([10, 20, 30, 100], budget=200)
    assert est.remaining(0) == 40 and est.remaining(25) == pytest.approx(65 - 25)
    assert est.remaining(150) == 50  # past every length seen: the budget's rest
    assert est.longest(5) == 95 and est.longest(120) == 80
    assert LengthEstimate([], budget=64).mean() == 64


def test_parse_split():
    assert parse_split("rollout=2,judge=1,train=1", 4) == ["rollout", "rollout", "judge", "train"]
    with pytest.raises(ValueError, match="world has 4: add 1"):
        parse_split("rollout=2,judge=1", 4)
    with pytest.raises(ValueError, match="remove 2"):
        parse_split("rollout=4,judge=2", 4)
    with pytest.raises(ValueError, match="unknown role 'critic'"):
        parse_split("rollout=3,critic=1", 4)
    with pytest.raises(ValueError, match="judge needs at least one rank"):
        parse_split("rollout=4", 4)
    with pytest.raises(ValueError, match="whole number"):
        parse_split("rollout=two,judge=2", 4)


def test_loop_adapter_reads_step_queues():
    report = lambda role, generated, seconds: SimpleNamespace(  # noqa: E731
        role=role, generated=generated, in_flight_tokens=sum(generated) + 10 * len(generated),
        engine_steps=[(len(generated), seconds, 0)] if generated else [], train_s=0.0, responses=[])
    request = lambda n: SimpleNamespace(prompt_ids=[0] * n, generated=[], max_tokens=64)  # noqa: E731
    queues = SimpleNamespace(
        prompts=[{"prompt_ids": [0] * 10}] * 2, update_book=SimpleNamespace(train_work=lambda: (0, 0, 1)),
        train_pool=None, spill=False, group_size=2, early_train=True,
        queued={"rollout": [], "judge": [request(50)] * 400}.__getitem__, round_s=0.05,
        timed_round=lambda: SimpleNamespace(seconds=0.05),
        reports=[report("rollout", [60], 0.02), report("rollout", [], 0.0), report("rollout", [], 0.0),
                 report("judge", [5, 9], 0.05)])
    adapter = LoopPlanner(SPEEDS, costs(0.01), LengthEstimate([20, 40, 64], 64), LengthEstimate([30], 96))
    roles = adapter(["rollout", "rollout", "rollout", "judge"], queues)
    assert roles.count("rollout") == 1 and roles[0] == "rollout"  # idle rollout ranks go to the judge backlog
    assert adapter.work(queues).rollout_seqs == 1 and adapter.work(queues).judge_seqs == 402
    assert adapter.work(queues).judge_prompt_tokens == 10 + 0 + LengthEstimate([20, 40, 64], 64).mean()
    # A response and its judge request: what of the judge prompt is neither prompt nor response is the
    # template, which a response still to come is priced with, as the simulator prices it.
    sample = SimpleNamespace(prompt_ids=[0] * 10, response_ids=[0] * 30)
    queues.reports[0].responses = [(sample, request(10 + 30 + 200))]
    adapter(["rollout", "rollout", "rollout", "judge"], queues)
    assert adapter.judge_template == 200 and adapter.state()["judge_template"] == 200
    assert adapter.work(queues).judge_prompt_tokens == 10 + 200 + LengthEstimate([20, 40, 64], 64).mean()


@settings(max_examples=100, deadline=None)
@given(work=works, held=assignments, cost=st.floats(0.01, 100))
def test_any_steady_workload_settles(work, held, cost):
    roles, since = [role for role, _, _ in held], [math.inf] * len(held)
    for _ in range(3 * len(held) + 3):
        moves = plan([Rank(r, 0, s) for r, s in zip(roles, since)], work, SPEEDS, costs(cost))
        roles = apply_moves(roles, moves)
        since = [0.0 if any(m.rank == i for m in moves) else s + cost * 10 for i, s in enumerate(since)]
    assert not moves  # settled: the last call moves nothing


def test_no_rank_is_sent_ahead_to_a_judge_with_nothing_to_judge():
    # The step's start: a long tail ahead, so the model would have a judge rank work through responses as
    # they come; but none has come yet, and a rank sent now would idle until they do.
    assert all(m.dst != "judge" for m in plan(ranks("rollout", "rollout"), START, SPEEDS, costs(1e-3)))
    waiting = replace(START, judge_seqs=64, judge_tokens=64 * 500, judge_prefill=64 * 2300)
    assert any(m.dst == "judge" for m in plan(ranks("rollout", "rollout", tokens=100), waiting, SPEEDS, costs(1e-3)))


def test_no_rank_is_sent_to_train_in_a_step_whose_rounds_train_nothing():
    # A step rolled out before the first update (--max-staleness > 0): its groups are judged, but no train
    # rank gets them (StepQueues.early_train is False), so a rank sent to train would idle.
    report = lambda role, generated: SimpleNamespace(role=role, generated=generated,  # noqa: E731
                                                     in_flight_tokens=sum(generated), engine_steps=[], train_s=0.0,
                                                     responses=[])
    queues = SimpleNamespace(
        prompts=[{"prompt_ids": [0] * 10}] * 4, update_book=SimpleNamespace(train_work=lambda: (4000, 8000, 0)),
        train_pool=None, spill=False, group_size=2,
        queued={"rollout": [], "judge": []}.__getitem__, round_s=0.05, early_train=True,
        timed_round=lambda: SimpleNamespace(seconds=0.05),
        reports=[report("judge", [5] * 60), report("judge", [30])])
    adapter = LoopPlanner(SPEEDS, costs(1e-4), LengthEstimate([20, 40, 64], 64), LengthEstimate([30, 90], 96),
                          PlannerConfig(early_train=True))
    assert "train" in adapter(["judge", "judge"], queues)  # the tail: a rank trains the judged groups
    adapter = LoopPlanner(SPEEDS, costs(1e-4), LengthEstimate([20, 40, 64], 64), LengthEstimate([30, 90], 96),
                          PlannerConfig(early_train=True))
    fill = SimpleNamespace(**{**vars(queues), "early_train": False})
    assert adapter.work(fill).train_ready == 0
    assert "train" not in adapter(["judge", "judge"], fill)


def test_engines_slowed_beside_training_make_early_training_pay_less():
    # The judge's tail: one rank still writes its critiques while the other, empty, could train the judged
    # groups early. Where a training rank slows the judge's engine steps enough, that no longer pays.
    work = Work(judge_seqs=30, judge_tokens=30 * 40, judge_longest=60, train_ready=4000, train_tokens=8000)
    held, config = [Rank("judge", 2000), Rank("judge", 0)], PlannerConfig(early_train=True)
    cheap = {**costs(0.01), ("train", "train"): 0.05}
    assert [m.dst for m in plan(held, work, SPEEDS, cheap, config)] == ["train"]
    assert plan(held, work, replace(SPEEDS, beside_train=3.0), cheap, config) == []
    counts = {"judge": 1, "train": 1}
    assert finish_seconds(work, counts, replace(SPEEDS, beside_train=2.0), cheap, True) > \
        finish_seconds(work, counts, SPEEDS, cheap, True)
    assert finish_seconds(work, {"judge": 2}, replace(SPEEDS, beside_train=2.0), cheap, True) == \
        finish_seconds(work, {"judge": 2}, SPEEDS, cheap, True)  # no rank trains: nothing slows


def adapter_round(*reports) -> SimpleNamespace:
    """A round as the loop's planner reads it (shifting.scheduler.StepQueues): nothing queued, and each rank's
    report, given as (role, engine steps, seconds trained), of 8 sequences of 5 tokens in flight."""
    return SimpleNamespace(prompts=[{"prompt_ids": [0] * 10}], train_pool=None, spill=False, group_size=2,
                           update_book=SimpleNamespace(train_work=lambda: (0, 0, 0)), early_train=True,
                           queued={"rollout": [], "judge": []}.__getitem__, round_s=0.05,
                           timed_round=lambda: SimpleNamespace(seconds=0.05),
                           reports=[SimpleNamespace(role=role, generated=[5] * 8, in_flight_tokens=80,
                                                    engine_steps=steps, train_s=train_s, responses=[])
                                    for role, steps, train_s in reports])


def new_adapter() -> LoopPlanner:
    return LoopPlanner(SPEEDS, costs(1e3), LengthEstimate([20, 40], 64), LengthEstimate([30], 96))


def test_loop_adapter_measures_the_engines_beside_training():
    # Judge steps of a round in which a rank trained take 1.5 times what the fit of the other rounds says:
    # the adapter's estimate moves halfway there each such round, and those steps leave the fit alone.
    adapter = new_adapter()
    fixed, per_seq = adapter.fits["judge"].fit()
    alone = fixed + per_seq * 8
    queues = adapter_round(("judge", [(8, 1.5 * alone, 0)] * 4, 0.0), ("train", [], 0.2))
    adapter(["judge", "train"], queues)
    assert adapter.measured_speeds().beside_train == pytest.approx(1.25)
    assert adapter.fits["judge"].fit() == (fixed, per_seq)
    adapter(["judge", "train"], queues)
    assert adapter.measured_speeds().beside_train == pytest.approx(1.375)
    assert adapter.state()["beside_train"] == pytest.approx(1.375)


def test_loop_adapter_weighs_the_prefill_speed_it_measured():
    # Two judge steps that took in 2,000 and 1,000 prompt tokens, 0.1 s and 0.05 s beyond the decode fit:
    # the planner weighs 20,000 tokens/s, not its prior. The rollout, with no such step, keeps its prior;
    # a resumed run keeps what was measured.
    adapter = new_adapter()
    fixed, per_seq = adapter.fits["judge"].fit()
    decode = fixed + per_seq * 8
    adapter(["judge"], adapter_round(("judge", [(8, decode + 0.1, 2000), (8, decode + 0.05, 1000)], 0.0)))
    speeds = adapter.measured_speeds()
    assert speeds.judge.prefill_per_s == pytest.approx(2e4)
    assert speeds.rollout.prefill_per_s == SPEEDS.rollout.prefill_per_s
    resumed = new_adapter()
    resumed.load_state(adapter.state())
    assert resumed.measured_speeds() == speeds


def test_first_empty_is_when_enough_engines_have_run_their_sequences_out():
    lengths = LengthEstimate([10, 20, 100], 100)  # a sequence at 15 tokens has 45 to go, one at 50 has 50
    speed = SPEEDS.rollout
    one = first_empty_seconds(speed, [[15]], lengths, 2)
    assert one == pytest.approx(45 * (speed.step_s + speed.per_seq_s))
    # Two engines, one of which must run empty to end a round of 2 ranks: the sooner.
    assert first_empty_seconds(speed, [[50, 50, 15], [15]], lengths, 2) == pytest.approx(one)
    # 16 ranks end a round once 2 have run empty: the later of the two.
    assert first_empty_seconds(speed, [[50, 50, 15], [15]], lengths, 16) > one
    assert first_empty_seconds(speed, [[15]], lengths, 16) is None  # too few engines to end it
    assert first_empty_seconds(speed, [], lengths, 2) is None
