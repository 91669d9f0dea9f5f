"""Rules of the scheduling book that the training loop (shifting/scheduler.py) and the simulator
(sim/engine.py) both follow. Pure: no torch, no engines, no clocks, so the simulator imports it as it is."""
import heapq


def shares(queued: int, in_flight: list[int], capacity: int) -> list[int]:
    """How many of `queued` requests each engine of one role takes, given the requests each already runs:
    one at a time to the engine running fewest (the lowest rank among equals), never above `capacity`.
    So the engines' loads even out: a rank that has just run empty beside one still running a full batch
    takes the whole queue, where equal shares of the queue would leave half of it waiting a round while
    the empty rank idles (the batch an engine runs sets its speed, not the queue's length)."""
    take = [0] * len(in_flight)
    room = [(n, rank) for rank, n in enumerate(in_flight) if n < capacity]
    heapq.heapify(room)
    for _ in range(queued):
        if not room:
            break
        n, rank = heapq.heappop(room)
        take[rank] += 1
        if n + 1 < capacity:
            heapq.heappush(room, (n + 1, rank))
    return take
