"""Which steps roll out around each update under --max-staleness K: one rule, which pivot_train.py and the
simulator (sim/engine.py) both follow.

Update u trains the samples of step u. At K = 0 step u rolls out and is judged just before, so the update
is on-policy. At K > 0 step u was rolled out and judged D updates earlier (`depth`), and step u + D rolls
out and is judged while update u's groups train; before the first update the pipeline is filled with the
first D steps, which have nothing to train beside them, and the last D updates roll nothing out. A step
rolled out after v updates is sampled by weights version v, so update u trains samples u - v <= D versions
old; under --updates ready the groups a step's rounds leave out go on into the next step and train one
update later, D + 1 = K versions old (shifting/book.py Book.may_end, Book.spill).
"""

UPDATES = ("ready", "step")  # --updates: which groups an update takes at K >= 2 (`depth`)


def depth(max_staleness: int, updates: str) -> int:
    """How many updates after the one beside which a step rolls out it is trained: K step-locked
    (`updates` "step": each update waits for its step's slowest group); K - 1 ready-first ("ready") at
    K >= 2, so that a group its step's rounds leave out can train one update later and keep the bound. At
    K = 1 ready-first is step-locked: a group begun under version v must train by update v + 1, which is
    the update the step-locked pipeline trains it in."""
    return max_staleness - 1 if updates == "ready" and max_staleness >= 2 else max_staleness


def rollouts(update: int, pending: int, depth: int, steps: int) -> tuple[range, int]:
    """For update `update` of `steps`, with `pending` steps already rolled out ahead of it, and the
    pipeline `depth` deep: the steps to roll out first with nothing to train (the pipeline's fill: none
    once it holds `depth`, or as many steps as are left), and the step rolled out beside the update (at or
    past `steps`: nothing is left to roll out)."""
    return range(update + pending, update + min(depth, steps - update)), update + depth
