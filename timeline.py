"""Which rank held which role when, for the pictures of a run. The timeline only observes: the role
context tells it of each shift this rank makes (`shifted`), the scheduler and the update mark the
time this rank works in a role (`busy`). Rank 0 writes every rank's spans to timeline.jsonl and draws
timeline.png (the run) and timeline_step.png (the step with the most role changes)."""
import json
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from roles import ROLES, Role
from runtime import Dist

COLOURS = {Role.ROLLOUT: "tab:blue", Role.JUDGE: "tab:orange", Role.TRAIN: "tab:green", "shift": "black"}


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
        """timeline.png, the whole run; timeline_step.png, the step after the first with the most role
        changes (a run with none: the most reloads), each shift labelled with the roles it went
        between."""
        if self.d.rank != 0 or not (self.out / "timeline.jsonl").exists():
            return
        spans = [json.loads(line) for line in open(self.out / "timeline.jsonl")]
        self._draw("timeline.png", spans, "the run", since="the run", origin=0.0)
        moves = [s for s in spans if s["role"] == "shift"]
        shifts = Counter(s["step"] for s in moves if s["from"] != s["to"]) or Counter(s["step"] for s in moves)
        if shifts:
            later = [k for k in shifts if k > 0] or list(shifts)  # step 0 also starts the engines and evaluates
            step = max(later, key=lambda k: (shifts[k], k))
            shown = [s for s in spans if s["step"] == step]
            self._draw("timeline_step.png", shown, f"step {step}: {shifts[step]} shifts (r rollout, j judge, t train)",
                       since=f"step {step}", origin=min(s["start"] for s in shown), label_shifts=True)

    def _draw(self, name: str, spans: list[dict], title: str, *, since: str, origin: float,
              label_shifts: bool = False) -> None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(12, 1 + 0.5 * self.d.world_size))
        for s in spans:
            shift = s["role"] == "shift"
            ax.barh(s["rank"], s["end"] - s["start"], left=s["start"] - origin, color=COLOURS[s["role"]],
                    hatch="//" if shift else None)
            if shift and label_shifts:
                ax.annotate(f"{s['from'][0]}>{s['to'][0]}", (s["start"] - origin, s["rank"] + 0.42),
                            fontsize=7, ha="left", va="bottom")
        ax.set_title(title)
        ax.set_xlabel(f"seconds since the start of {since}")
        ax.set_ylabel("rank")
        ax.set_yticks(range(self.d.world_size))
        ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()],
                  labels=list(COLOURS), loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        fig.savefig(self.out / name, dpi=100)
        plt.close(fig)
