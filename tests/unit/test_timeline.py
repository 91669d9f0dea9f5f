"""The timeline's pictures from timeline.jsonl-like spans: which step timeline_step.png draws, that both
pictures are drawn with the phases of a run, and the check that a run's spans leave no rank's time
unaccounted for (`timeline_gaps`, which tests/e2e/test_train_e2e.py applies to a real run)."""
import pytest

from conftest import timeline_gaps
from report import draw_timeline, step_to_draw
from roles import PHASES


def span(step, rank, role, start, end, **moved):
    return {"step": step, "rank": rank, "role": role, "start": start, "end": end, **moved}


def shift(step, rank, start, before, after):
    return span(step, rank, "shift", start, start + 0.05, **{"from": before, "to": after})


def colocated_run(steps=5, evaluated=(0, 4), checkpointed=(3,)) -> list[dict]:
    """A two-rank run as pivot_train.py records it: the start-up, then each step (its evaluation first
    where due) rolls out, judges and trains, the ranks waiting at the exchanges, and a checkpoint after
    the steps due; the final evaluation and the export close it."""
    spans, t = [], 10.0
    for rank in (0, 1):
        spans.append(span(0, rank, "startup", 0.0, t))
    for step in range(steps + 1):
        if step in evaluated or step == steps:
            for rank in (0, 1):
                spans += [span(step, rank, "eval", t, t + 2.0), shift(step, rank, t + 0.1, "rollout", "judge"),
                          shift(step, rank, t + 1.5, "judge", "rollout")]
            t += 2.0
        if step == steps:
            break
        for rank in (0, 1):
            spans += [span(step, rank, "rollout", t, t + 1.0), span(step, rank, "wait", t + 1.0, t + 1.1),
                      shift(step, rank, t + 1.1, "rollout", "judge"), span(step, rank, "judge", t + 1.15, t + 2.0 - rank),
                      span(step, rank, "wait", t + 2.0 - rank, t + 2.1), shift(step, rank, t + 2.1, "judge", "train"),
                      span(step, rank, "train", t + 2.15, t + 3.0), shift(step, rank, t + 3.0, "train", "rollout")]
        t += 3.05
        if step in checkpointed:
            for rank in (0, 1):
                spans.append(span(step, rank, "checkpoint", t, t + 0.5))
            t += 0.5
    for rank in (0, 1):
        spans.append(span(steps, rank, "export", t, t + 0.3))
    return spans


def test_a_run_whose_spans_cover_it_has_no_gap():
    assert timeline_gaps(colocated_run()) == []


def test_a_phase_left_unrecorded_is_a_gap_on_each_rank():
    spans = colocated_run()
    evaluation = next(s for s in spans if s["role"] == "eval" and s["step"] == 4)
    left = [s for s in spans if not (s["role"] == "eval" and s["step"] == 4)]
    # the shifts made in the evaluation split its 2 s into stretches of 0.1, 1.35 and 0.45 s
    start = evaluation["start"]
    assert timeline_gaps(left) == [(0, pytest.approx(start + 0.15), start + 1.5),
                                   (1, pytest.approx(start + 0.15), start + 1.5)]
    assert timeline_gaps(left, longest=1.5) == []


def test_the_step_drawn_has_no_evaluation_or_checkpoint():
    # every step shifts alike, so the latest is drawn that has no evaluation (step 4) and no checkpoint (3)
    assert step_to_draw(colocated_run()) == (2, 6)


def test_where_every_step_has_a_phase_the_latest_with_the_most_shifts_is_drawn():
    # steps 1 and 2 shift six times in training and four in their evaluations; step 3 only evaluates
    assert step_to_draw(colocated_run(steps=3, evaluated=(0, 1, 2), checkpointed=(0, 1, 2))) == (2, 10)


def test_a_simulated_run_without_phases_draws_as_before():
    spans = [s for s in colocated_run(evaluated=(), checkpointed=()) if s["role"] not in PHASES and s["step"] < 5]
    assert step_to_draw(spans) == (4, 6)
    assert step_to_draw([s for s in spans if s["role"] != "shift"]) is None


def test_both_pictures_are_drawn_with_the_phases(tmp_path):
    draw_timeline(tmp_path, colocated_run(), 2)
    assert (tmp_path / "timeline.png").stat().st_size > 0 and (tmp_path / "timeline_step.png").stat().st_size > 0
