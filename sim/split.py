"""The best fixed split of slots between rollout, the judge and training: what a disaggregated baseline
deserves, found by simulating splits."""
import math

from roles import Role

GOLDEN = (math.sqrt(5) - 1) / 2


def best_split(slots: int, min_train: int, seconds, unit: int = 1) -> tuple[dict[str, int], int]:
    """The split of `slots` with the fewest `seconds(split)` (a simulated run of it), each role's count a
    multiple of `unit` (a node's worth of slots, as clusters are split), searched as two nested
    golden-section searches: over the train count, each judged by its best judge count, itself searched
    over the judge counts, the rest rolling out. Exact where the seconds are unimodal in each count
    (more judge slots help until rollout starves, more train slots until the engines starve);
    tests/unit/test_sim.py checks it against every split of a small case. Returns the best split and how
    many splits were simulated."""
    if slots % unit:
        raise ValueError(f"{slots} slots do not divide into units of {unit}")
    units, least = slots // unit, -(-min_train // unit)
    if units - least < 2:
        raise ValueError(f"{slots} slots cannot hold a disaggregated split: train needs {min_train}, the judge "
                         f"and rollout {unit} each; simulate more devices")
    seen = {}

    def run(train: int, judge: int) -> float:
        if (train, judge) not in seen:
            split = {Role.ROLLOUT: units - train - judge, Role.JUDGE: judge, Role.TRAIN: train}
            seen[train, judge] = seconds({role: n * unit for role, n in split.items()})
        return seen[train, judge]

    def best_judge(train: int) -> int:
        return argmin(lambda judge: run(train, judge), 1, units - train - 1)

    train = argmin(lambda t: run(t, best_judge(t)), least, units - 2)
    judge = best_judge(train)
    return {Role.ROLLOUT: (units - train - judge) * unit, Role.JUDGE: judge * unit, Role.TRAIN: train * unit}, len(seen)


def node_unit(slots: int, node_slots: int, min_train: int) -> int:
    """A node's slots as the unit of a split (clusters are split by node), halved until `slots` hold a unit
    of rollout, one of the judge and the units the training state needs, and until it divides them."""
    unit = max(1, node_slots)
    while unit > 1 and (slots % unit or slots // unit < -(-min_train // unit) + 2):
        unit //= 2
    return unit


def argmin(f, lo: int, hi: int) -> int:
    """The integer in [lo, hi] where a unimodal `f` is least (the lowest such on ties), by golden-section
    search: each step keeps the 0.618 of the interval that holds the least, evaluating f once per point."""
    values = {}

    def at(x: int) -> float:
        if x not in values:
            values[x] = f(x)
        return values[x]

    a, b = lo, hi
    while b - a > 4:
        c, d = b - round(GOLDEN * (b - a)), a + round(GOLDEN * (b - a))
        if at(c) < at(d):
            b = d - 1
        elif at(c) > at(d):
            a = c + 1
        else:
            a, b = c, d
    return min(range(a, b + 1), key=lambda x: (at(x), x))
