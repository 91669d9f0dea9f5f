"""Deliberate crashes, for the restart tests and for trying a setup's recovery by hand.

With PIVOT_KILL=RANK:POINT:N in the environment, rank RANK kills itself with SIGKILL (as `kill -9`
would) the Nth time it passes POINT, in torchrun's first launch only, so that the restarted group runs
through. The points:
    rollout, judge  an engine step in that role has just run
    train           a minibatch's gradients are computed, the optimizer has not stepped
    shift           a role change has offloaded the old role and not yet onloaded the new one
    checkpoint      rank 0 has written a checkpoint's state, not yet renamed it into place
"""
import os
import signal

from roles import ROLES

POINTS = (*ROLES, "shift", "checkpoint")
_passed: dict[str, int] = {}


def point(name: str, rank: int) -> None:
    spec = os.environ.get("PIVOT_KILL")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    target, where, nth = parse(spec)
    if rank != target or name != where:
        return
    _passed[name] = _passed.get(name, 0) + 1
    if _passed[name] == nth:
        os.kill(os.getpid(), signal.SIGKILL)


def parse(spec: str) -> tuple[int, str, int]:
    parts = spec.split(":")
    if len(parts) != 3 or parts[1] not in POINTS or not parts[0].isdigit() or not parts[2].isdigit():
        raise ValueError(f"PIVOT_KILL={spec!r}: expected RANK:POINT:N with POINT one of {', '.join(POINTS)}, "
                         f"e.g. PIVOT_KILL=1:train:2")
    return int(parts[0]), parts[1], int(parts[2])
