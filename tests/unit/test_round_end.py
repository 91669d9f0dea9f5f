"""A timed round's end, agreed through a real TCPStore by ranks in one process (each with its own two
clients, as runtime.init_distributed gives a rank): every rank learns of it, and none asks the store
between its engine steps."""
import time

import pytest
import torch.distributed as dist

from shifting.scheduler import RoundEnd, Rounds

STEP = 3


class Counted:
    """A store that counts the requests made through it."""

    def __init__(self, store):
        self.store, self.requests = store, 0

    def __getattr__(self, name):
        call = getattr(self.store, name)

        def counted(*args):
            self.requests += 1
            return call(*args)
        return counted


@pytest.fixture
def ranks():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def make(world_size: int) -> list[RoundEnd]:
        ends = []
        for _ in range(world_size):
            client = dist.PrefixStore("launch/", dist.TCPStore("127.0.0.1", server.port, is_master=False))
            ends.append(RoundEnd(Counted(client), client.clone(), world_size, STEP))
        for end in ends:
            end.next()
        return ends
    yield make, server


def asked_for(ends: list[RoundEnd], seconds: float) -> list[bool]:
    """Each rank's answer after asking whether the round is over, as between engine steps, for `seconds`."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        answers = [end.over() for end in ends]
        time.sleep(0.001)
    return answers


def learn(ends: list[RoundEnd], timeout: float = 5.0) -> list[bool]:
    until = time.perf_counter() + timeout
    while not all(end.over() for end in ends) and time.perf_counter() < until:
        time.sleep(0.001)
    return [end.over() for end in ends]


def test_every_rank_learns_of_the_rounds_end_from_the_last_arrival_without_asking_the_store(ranks):
    make, server = ranks
    ends = make(4)
    for end in ends[:3]:
        end.arrive()
    assert asked_for(ends, 0.3) == [False] * 4  # a rank still working holds the round
    # 300 questions each, one request each so far: its arrival (the old look-up asked every 10 ms)
    assert [end.store.requests for end in ends] == [1, 1, 1, 0]
    ends[3].arrive()
    assert ends[3].over()  # its own add ended the round
    assert learn(ends) == [True] * 4
    assert [end.store.requests for end in ends] == [1, 1, 1, 2]  # the last: its add and the key it sets
    for end in ends:
        end.leave()
        assert end.watcher is None or not end.watcher.is_alive()
    ends[0].forget()
    assert not server.check([f"launch/{ends[0].key}", f"launch/{ends[0].over_key}"])


def test_enough_ranks_run_empty_end_the_round_for_ranks_still_working(ranks):
    make, _ = ranks
    ends = make(8)  # an eighth of 8: one rank run empty is enough
    early = Rounds(seconds=60.0, early=True)
    start = time.perf_counter()
    assert [end.stop(early, start) for end in ends] == [False] * 8
    ends[0].end_now()
    assert learn(ends[1:]) == [True] * 7
    assert all(end.stop(early, start) for end in ends[1:])  # before their time, they stop
    for end in ends[1:]:
        end.arrive()
    for end in ends:
        end.leave()


def test_the_next_round_is_its_own_and_a_round_nobody_times_starts_no_thread(ranks):
    make, _ = ranks
    ends = make(2)
    for end in ends:
        end.arrive()
    assert learn(ends) == [True, True]
    for end in ends:
        end.leave()
        end.next()
    assert [end.over() for end in ends] == [False, False]  # round 2 has its own key
    ends[0].arrive()
    ends[1].end_now()
    assert learn(ends) == [True, True]
    for end in ends:
        end.leave()
        end.next()
    untimed = Rounds()
    assert not any(end.stop(untimed, 0.0) for end in ends)
    assert all(end.watcher is None for end in ends)
