"""What a round's exchange with rank 0 costs as ranks grow, for the simulator's GPU model (sim/calibration.json,
loop.exchange_* and loop.plan_s): the two collectives of shifting/scheduler.py's `_exchange` over gloo
(every rank's report gathered by rank 0, its orders scattered back), with a report and orders of a
mid-step round's size, and the pivot planner's plan over as many ranks as a cluster has.

    python bench/exchange.py [--ranks 2,4,8] [--rounds 300] [--plan-ranks 128] [--json PATH]

Each world size runs under torchrun on this machine, over loopback: the figure leaves out the network's
latency between nodes and, where ranks outnumber cores, includes their waits for a core. It prints the
median seconds per round at each size, the least-squares line seconds = fixed + per_rank x ranks, and
what rank 0 itself spends on each rank (unpickling its report, pickling its orders), which grows with
the ranks however many cores the machine has: on a loaded machine of few cores, the line's slope
measures the ranks' waits for a core rather than the exchange.
"""
import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import planner  # noqa: E402
import result_files  # noqa: E402
from roles import ROLES, Role  # noqa: E402

# A rollout rank's report in the middle of a step: 64 sequences in flight, 25 engine steps, a few finished
# responses (ids, logprobs) and their judge requests; its orders: every rank's role and a few requests.
IN_FLIGHT, STEPS, FINISHED, TOKENS = 64, 25, 4, 2048


def report() -> dict:
    response = {"prompt_ids": [1] * 256, "response_ids": [2] * TOKENS, "logprobs": [-0.5] * TOKENS}
    return {"role": Role.ROLLOUT, "responses": [(response, {"prompt_ids": [3] * (256 + TOKENS)})] * FINISHED,
            "verdicts": [], "exported": [], "generated": [TOKENS] * IN_FLIGHT,
            "in_flight_tokens": IN_FLIGHT * (256 + TOKENS), "engine_steps": [(IN_FLIGHT, 0.02, 0)] * STEPS}


def orders(world: int) -> dict:
    return {"roles": [Role.ROLLOUT] * world, "work": [{"prompt_ids": [1] * 256, "max_tokens": 20480}] * FINISHED,
            "rounds": (None, 0.5, True)}


def worker(rounds: int) -> None:
    """One rank: `rounds` exchanges back to back, as the loop makes them; rank 0 prints the median."""
    import torch.distributed as dist
    from runtime import init_distributed, shutdown_distributed
    d = init_distributed()
    mine, theirs = report(), [orders(d.world_size)] * d.world_size
    seconds = []
    for i in range(rounds + 20):  # the first 20 warm the connections up
        start = time.perf_counter()
        gathered = [None] * d.world_size if d.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=d.control)
        out = [None]
        dist.scatter_object_list(out, theirs if d.rank == 0 else None, src=0, group=d.control)
        if i >= 20:
            seconds.append(time.perf_counter() - start)
    if d.rank == 0:
        print(json.dumps({"ranks": d.world_size, "round_s": statistics.median(seconds),
                          "report_bytes": len(pickle.dumps(mine)), "orders_bytes": len(pickle.dumps(theirs[0]))}))
    del d.control
    shutdown_distributed(d)


def handling_seconds(world: int, repeats: int = 300) -> float:
    """Rank 0's own work per rank in an exchange: one report unpickled, one rank's orders pickled."""
    data, theirs = pickle.dumps(report()), orders(world)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        pickle.loads(data)
        pickle.dumps(theirs)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def plan_seconds(ranks: int, repeats: int = 30) -> float:
    """The median seconds of planner.plan over `ranks` ranks in the middle of a step: rollout in its tail,
    the judge behind, some groups judged."""
    speed = planner.EngineSpeed(step_s=0.02, per_seq_s=2e-4, prefill_per_s=2e4, max_seqs=64)
    speeds = planner.Speeds(speed, speed, train_per_s=5e3)
    costs = {(a, b): 2.0 for a in ROLES for b in ROLES if a != b}
    work = planner.Work(rollout_seqs=ranks * 4, rollout_tokens=ranks * 4 * 3000.0, rollout_longest=15000,
                        judge_seqs=ranks * 20, judge_tokens=ranks * 20 * 400.0, judge_prefill=ranks * 10 * 5000.0,
                        critique_tokens=400, judge_prompt_tokens=5000, train_ready=ranks * 5000.0,
                        train_tokens=ranks * 80 * 5000.0)
    roles = [Role.ROLLOUT] * (ranks // 2) + [Role.JUDGE] * (ranks - ranks // 2)
    state = [planner.Rank(role, 4 * 5000 if role == Role.ROLLOUT else 20 * 5000, 100.0) for role in roles]
    config = planner.PlannerConfig(early_train=True)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        planner.plan(state, work, speeds, costs, config)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares of seconds = fixed + per_rank x ranks."""
    n, x, y = len(points), sum(p[0] for p in points), sum(p[1] for p in points)
    xx, xy = sum(p[0] ** 2 for p in points), sum(p[0] * p[1] for p in points)
    per_rank = (n * xy - x * y) / (n * xx - x * x) if n > 1 else 0.0
    return (y - per_rank * x) / n, per_rank


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="2,4,8", help="world sizes to run, comma-separated")
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--plan-ranks", type=int, default=128)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.rounds)
        return
    sizes = [int(n) for n in args.ranks.split(",")]
    if len(set(sizes)) < 2 or min(sizes) < 1:
        sys.exit("--ranks needs at least two world sizes, e.g. 1,2: the line is fitted over them")
    rows = []
    for n in sizes:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
               str(Path(__file__).resolve()), "--worker", "--rounds", str(args.rounds)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            sys.exit(f"{n} ranks failed ({' '.join(cmd)}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        rows.append(json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{"))))
        print(f"{n:4d} ranks: {rows[-1]['round_s'] * 1e3:7.2f} ms per exchange (report {rows[-1]['report_bytes']} B, "
              f"orders {rows[-1]['orders_bytes']} B)", flush=True)
    fixed, per_rank = fit([(r["ranks"], r["round_s"]) for r in rows])
    handling, plan = handling_seconds(args.plan_ranks), plan_seconds(args.plan_ranks)
    print(f"fit: {fixed * 1e3:.2f} ms + {per_rank * 1e3:.3f} ms per rank ({os.cpu_count()} cores; loopback)")
    print(f"rank 0's own work per rank: {handling * 1e3:.3f} ms; planner.plan over {args.plan_ranks} ranks: "
          f"{plan * 1e3:.2f} ms")
    if args.json:
        result_files.write(args.json, {"rows": rows, "fixed_s": fixed, "per_rank_s": per_rank,
                                               "handling_per_rank_s": handling, "cpus": os.cpu_count(),
                                               "plan_ranks": args.plan_ranks, "plan_s": plan})


if __name__ == "__main__":
    main()
