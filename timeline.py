"""Which rank held which role when, for the pictures of a run. The timeline only observes: the role
context tells it of each shift this rank makes (`shifted`), the scheduler and the update mark the
time this rank works in a role (`busy`). Rank 0 writes every rank's spans to timeline.jsonl and draws
timeline.png (the run) and timeline_step.png (the step with the most role changes)."""
import json
import time
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from report import draw_timeline
from roles import ROLES
from runtime import Dist


class Timeline:
    def __init__(self, d: Dist, out: Path):
        self.d, self.out, self.spans, self.step = d, out, [], 0
        # One origin for every rank (rank 0's wall clock, which nodes keep in sync), so that the ranks'
        # spans line up in the pictures: each process's own start differs by its start-up time.
        origin = [time.time()]
        dist.broadcast_object_list(origin, src=0, group=d.control)
        self.t0 = origin[0]

    def now(self) -> float:
        return time.time() - self.t0

    def begin_step(self, step: int) -> None:
        self.step = step

    @contextmanager
    def busy(self, role: str):
        """Marks this rank busy in `role`; back-to-back periods in one role merge into one span."""
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
        """Collective: gathers the step's spans; returns each role's busy seconds summed over ranks."""
        per_rank = [None] * self.d.world_size
        dist.all_gather_object(per_rank, [s for s in self.spans if s["step"] == self.step], group=self.d.control)
        self.spans = [s for s in self.spans if s["step"] != self.step]
        spans = [s for got in per_rank for s in got]
        busy = dict.fromkeys(ROLES, 0.0)
        for s in spans:
            if s["role"] in busy:
                busy[s["role"]] += s["end"] - s["start"]
        if self.d.rank == 0:
            with open(self.out / "timeline.jsonl", "a") as f:
                f.writelines(json.dumps(s) + "\n" for s in spans)
        return {"busy_s": busy}

    def draw(self) -> None:
        """timeline.png and timeline_step.png (report.draw_timeline), from every rank's spans."""
        if self.d.rank != 0 or not (self.out / "timeline.jsonl").exists():
            return
        draw_timeline(self.out, [json.loads(line) for line in open(self.out / "timeline.jsonl")], self.d.world_size)
