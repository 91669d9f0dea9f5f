"""The scheduling book's rules (shifting/book.py), which the loop and the simulator both call."""
from shifting.book import empty_enough, round_seconds, shares


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
