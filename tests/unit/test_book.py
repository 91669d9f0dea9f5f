"""The scheduling book's rules (shifting/book.py), which the loop and the simulator both call."""
from shifting.book import ahead_step, empty_enough, publish_due, round_seconds, shares, update_due


def test_shares_even_out_loads_up_to_capacity():
    assert shares(128, [0, 0], 64) == [64, 64]
    assert shares(5, [0, 0], 64) == [3, 2]  # the lower rank among equals first
    # A rank run empty beside a full one takes the whole queue, up to its room.
    assert shares(64, [0, 64], 64) == [64, 0]
    assert shares(80, [0, 64], 64) == [64, 0]
    assert shares(10, [50, 44, 60], 64) == [2, 8, 0]  # rank 1 to 50 first, then turn about: 52, 52, 60
    assert shares(0, [1, 2], 64) == [0, 0]
    assert shares(3, [], 64) == []


def test_round_seconds_and_early_end():
    assert round_seconds(25, None, 0.0, 0.0) == 25 * 0.002
    assert round_seconds(25, 0.01, 0.0, 0.0) == 0.25
    assert round_seconds(25, 0.01, 0.0, 0.1) == 2.0  # 20 exchanges
    assert round_seconds(25, 0.01, 0.5, 0.0) == 5.0  # 10 of the longest step
    assert [empty_enough(n) for n in (1, 2, 8, 9, 128)] == [1, 1, 1, 2, 16]


def test_run_ahead_rules():
    assert update_due(True, True, False)  # an earlier step's groups, all trained early: made now
    assert not update_due(True, True, True)  # once
    assert not update_due(True, False, False) and not update_due(False, True, False)
    assert publish_due(True, False, True)  # made, not out yet, a next step to begin
    assert not publish_due(True, True, True) and not publish_due(False, False, True)
    assert not publish_due(True, False, False)  # nothing to begin: it goes out at the step's end
    assert ahead_step(3, 1, 10, False) == 4
    assert ahead_step(3, 0, 10, False) is None  # on-policy: nothing runs ahead
    assert ahead_step(3, 2, 4, False) is None  # the run's last step: none left to begin
    assert ahead_step(3, 2, 10, True) is None  # the update ends in a checkpoint: whole steps only


def test_the_step_begun_ahead_is_the_one_the_loop_and_the_simulator_each_had():
    """ahead_step against the rules each side wrote before they called it: the loop began the next step's
    prompts (`prompts(step, later=1) or None`: none at or past --steps) at K > 0 unless the update ended
    in a checkpoint; the simulator `beside + 1 if k and beside + 1 < last else None`."""
    for k in range(4):
        for steps in range(1, 8):
            for step in range(steps + k):
                loop = step + 1 if k > 0 and step + 1 < steps else None
                assert ahead_step(step, k, steps, False) == loop == (step + 1 if k and step + 1 < steps else None)
                assert ahead_step(step, k, steps, True) is None
