"""Which rank held which role when, for the pictures of a run. The timeline only observes: the role
context tells it of each shift this rank makes (`shifted`), the scheduler and the update mark the
time this rank works in a role (`busy`) and waits at a round's exchange for the other ranks (WAIT), and
the loop marks the parts of the run outside a step's roles (PHASES: `started`, `busy`). Rank 0 writes
every rank's spans to timeline.jsonl and draws timeline.png (the run) and timeline_step.png (a step
with the most role changes and no phase in it)."""
import json
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import torch.distributed as dist

from report import draw_timeline
from roles import ROLES
from runtime import Dist


class Timeline:
    def __init__(self, d: Dist, out: Path):
        self.d, self.out, self.spans, self.step = d, out, [], 0
        # One origin for every rank, the first process's start (wall clocks, which nodes keep in sync),
        # so that the ranks' spans line up and the pictures hold the imports and the start-up too.
        self.began = psutil.Process().create_time()
        starts = [None] * d.world_size
        dist.all_gather_object(starts, self.began, group=d.control)
        self.t0 = min(starts)

    def now(self) -> float:
        return time.time() - self.t0

    def begin_step(self, step: int) -> None:
        self.step = step

    def started(self) -> None:
        """The start-up is over: this rank's span from its process's start to now (imports, data, the
        engines, the trainer, the storage, the first roles)."""
        self.spans.append({"step": self.step, "rank": self.d.rank, "role": "startup",
                           "start": self.began - self.t0, "end": self.now()})

    @contextmanager
    def busy(self, role: str):
        """Marks this rank busy in `role` (a role, WAIT or one of PHASES); back-to-back periods in one
        role merge into one span."""
        start = self.now()
        yield
        end = self.now()
        last = self.spans[-1] if self.spans else None
        if last and last["step"] == self.step and last["role"] == role and start - last["end"] < 0.05:
            last["end"] = end
        else:
            self.spans.append({"step": self.step, "rank": self.d.rank, "role": role, "start": start, "end": end})

    def shifted(self, record: dict, start: float) -> None:
        """This rank's shift (a record of `RoleContext.apply`), begun at `start` (`now()` then)."""
        self.spans.append({"step": self.step, "rank": self.d.rank, "role": "shift", "from": record["from"],
                           "to": record["to"], "start": start, "end": start + record["seconds"]})

    def close_step(self) -> dict:
        """Collective: writes the spans held (the step's, and a checkpoint after the step before);
        returns each role's busy seconds in the step summed over ranks."""
        busy = dict.fromkeys(ROLES, 0.0)
        for s in self._write():
            if s["role"] in busy and s["step"] == self.step:
                busy[s["role"]] += s["end"] - s["start"]
        return {"busy_s": busy}

    def draw(self) -> None:
        """Collective: writes the spans left (the last evaluation, the export), then rank 0 draws
        timeline.png and timeline_step.png (report.draw_timeline) from every rank's spans."""
        self._write()
        if self.d.rank == 0:
            draw_timeline(self.out, [json.loads(line) for line in open(self.out / "timeline.jsonl")],
                          self.d.world_size)

    def _write(self) -> list[dict]:
        """Collective: every rank's spans held, appended to timeline.jsonl by rank 0 and returned."""
        per_rank = [None] * self.d.world_size
        dist.all_gather_object(per_rank, self.spans, group=self.d.control)
        self.spans = []
        spans = [s for got in per_rank for s in got]
        if self.d.rank == 0:
            with open(self.out / "timeline.jsonl", "a") as f:
                f.writelines(json.dumps(s) + "\n" for s in spans)
        return spans
