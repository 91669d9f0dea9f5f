"""Which steps roll out around each update under --max-staleness K: one rule, which pivot_train.py and the
simulator (sim/engine.py) both follow.

Update u trains the samples of step u. At K = 0 step u rolls out and is judged just before, so the update
is on-policy. At K > 0 step u was rolled out and judged K updates earlier, and step u + K rolls out and
is judged while update u's groups train; before the first update the pipeline is filled with the first K
steps, which have nothing to train beside them, and the last K updates roll nothing out. A step rolled
out after v updates is sampled by weights version v, so update u trains samples u - v <= K versions old.
"""


def rollouts(update: int, pending: int, max_staleness: int, steps: int) -> tuple[range, int]:
    """For update `update` of `steps`, with `pending` steps already rolled out ahead of it: the steps to
    roll out first with nothing to train (the pipeline's fill: none once it holds K, or as many steps as
    are left), and the step rolled out beside the update (at or past `steps`: nothing is left to roll out)."""
    return range(update + pending, update + min(max_staleness, steps - update)), update + max_staleness
