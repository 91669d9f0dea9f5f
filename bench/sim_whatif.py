"""Which of the simulator's assumptions set the pivot ratios at cluster scale: each model group at --gpus,
as calibrated and with one workload or cost figure changed at a time, side by side.

    python bench/sim_whatif.py [--preset h200|paper] [--gpus 128] [--model-group all] [--steps 2] [--json PATH]
    python bench/sim_whatif.py --measured bench/results/placements-longtail.json --max-staleness 2

For every case it prints pivot@K/colocated@0, pivot@K/disaggregated@K and pivot@K over its bound, the
share of colocated's device-seconds spent idle (all that moving devices between roles can fill), the
share of pivot's spent waiting for other devices with work in hand (a round held open, a collective
shift), and how colocated's step divides: until the last response, then the last verdict, then the end
of the update. The changed
figures are not calibrated: they ask what the ratios would be if the workload or the costs were so.
Some cases change the loop's rounds instead (sim.engine.RoundRules), to rules pivot_train.py does not
follow or does not follow by default (`step-locked`: --updates step): they ask what each of its rules is
worth. `--preset paper` asks the same of the paper's setup
(128 H20, K = 2; disaggregated's split sized to each role's work unless `--split search`). `--measured`
asks it of this machine instead: the costs bench/placements.py measured (its --json), on its ranks, for
the cases that change the rounds alone (the others change a preset's figures, which it does not use).
"""
import argparse
import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import result_files  # noqa: E402
from roles import ENGINE_ROLES, Role  # noqa: E402
from sim.__main__ import PAPER, simulate  # noqa: E402
from sim.calibration import load, preset  # noqa: E402


# name -> (what it asks, {calibration entry ({hw}: the preset's hardware section): factor applied to its value},
# {RoundRules field: value})
CASES = {
    "as calibrated": ("", {}, {}),
    "128 prompts": ("a quarter of the prompts per step: fewer sequences per device, so the tail weighs more",
                    {"workload.prompts_per_step": 0.25}, {}),
    "tail p99 30x": ("responses with p99 at 30x the median instead of 10x (same budget)",
                     {"workload.response_p99_over_median": 3.0}, {}),
    "critiques 8k": ("a judge that reasons at RM-R1's length: 8,192-token critiques",
                     {"workload.max_critique_tokens": 2.0}, {}),
    "free shifts": ("moves and publishing that cost nothing: wake 0 s, host and node links 1,000x faster",
                    {"{hw}.engine_wake_s": 0.0, "{hw}.h2d_bytes_per_s": 1000.0, "{hw}.d2h_bytes_per_s": 1000.0,
                     "{hw}.node_link_bytes_per_s": 1000.0}, {}),
    "rounds x16": ("rounds of 400 engine steps' worth of time instead of 25 (pivot_train.py --round-steps 400)",
                   {}, {"round_steps": 400}),
    "stop at limit": ("a slot past the round's limit stops and waits for the round's end instead of stepping "
                      "on until every slot has reached it", {}, {"step_on": False}),
    "train waits": ("train slots through their groups wait for the round's end, where the loop's end an early "
                    "round as an engine run empty does and take other work", {}, {"trained_through": False}),
    "migrate late": ("the running sequences of a slot that leaves its role are queued at the next exchange, "
                     "idle for a round, where the loop's go on in the round it leaves in", {},
                     {"migrate_at_once": False}),
    "shifts stall": ("every shift holds every slot until the longest one is done, a shift between engine "
                     "roles too", {}, {"shifts_stall_all": True}),
    "light tails": ("responses and critiques with p99 at 3x the median instead of 10x (same budgets): about what "
                    "a round that need not wait for its step's slowest samples would see",
                    {"workload.response_p99_over_median": 0.3, "workload.critique_p99_over_median": 0.3}, {}),
    "short critiques": ("a judge that writes a fifth of the critique budget (paper: 4,096 tokens, not a "
                        "thinking judge's 20,480)", {"workload.max_critique_tokens": 0.2}, {}),
    "train 2x": ("training at twice the utilisation", {"{hw}.train_flops": 2.0}, {}),
    "prefill intake": ("pivot's engines of both roles, at any K, take new work only as far as they prefill it "
                       "within the round; the rest waits at rank 0 for the planner and for slots that join the "
                       "role (the loop: the judge's at K = 0 alone, book.prefill_budget)",
                       {}, {"prefill_intake": ENGINE_ROLES}),
    "judge prefill budget": ("pivot's judge engines, at any K, take new work only as far as they prefill it within "
                             "the round, as the loop's do at K = 0 alone (book.prefill_budget); the rollout engines "
                             "up to their room", {}, {"prefill_intake": (Role.JUDGE,)}),
    "no prefill budget": ("at K = 0 pivot's judge engines take new work up to their intake, not only as far as "
                          "they prefill it within the round (book.prefill_budget, the loop's rule)", {},
                          {"prefill_budget": False}),
    "judge room": ("pivot's judge engines take responses up to their room, not only as many as they step well "
                   "(book.intake, the loop's rule)", {}, {"intake": False}),
    "deep pipeline": ("step-locked at K > 0, each update waiting for its own step alone, with up to K + 1 steps "
                      "in flight, each begun once weights K updates older than its own update are out (not in the "
                      "loop, whose step-locked pipeline rolls step u + K out to its end beside update u)", {},
                      {"deep_pipeline": True, "updates": "step"}),
    "carry running": ("as a step ends the engines go on with the next step's sequences where they are (not in "
                      "the loop, which exports them and prefills them again in the next step)", {},
                      {"carry_running": True}),
    "deep + carry": ("deep pipeline and carry running together", {},
                     {"deep_pipeline": True, "carry_running": True, "updates": "step"}),
    "step-locked": ("at K >= 2 each update waits for its step's slowest group, the pipeline K deep (pivot_train.py "
                    "--updates step), instead of ending a step with up to half of its groups still out, which train "
                    "an update later (--updates ready, the loop's default)", {}, {"updates": "step"}),
    "rollout hold": ("pivot's rollout engines hold up to twice their room (--max-seqs): they step that many at "
                     "once and start the others as those finish, as vLLM's scheduler queues what is beyond its "
                     "max_num_seqs, so an engine does not run its batch down to empty while prompts wait at rank "
                     "0 for the next round (the loop's take their room)", {}, {"rollout_hold": 2.0}),
    "rounds short": ("rounds of 25 median engine steps and 20 exchanges, not also 10 of the longest recent steps "
                     "(a prefill chunk): the planner acts more often", {}, {"over_longest": 0}),
}


def case_calibration(base: dict, factors: dict) -> dict:
    """A copy of `base` with each named entry's value multiplied by its factor."""
    cal = copy.deepcopy(base)
    for path, factor in factors.items():
        node = cal
        for key in path.split("."):
            node = node[key]
        node["value"] *= factor
    return cal


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=["h200", "paper"], default="h200")
    p.add_argument("--gpus", type=int, default=None, help="default 128; with --measured, the bench's ranks")
    p.add_argument("--model-group", default="all")
    p.add_argument("--max-staleness", type=int, default=None, metavar="K", help="default 0; paper: 2")
    p.add_argument("--split", choices=["share", "search"], default="share",
                   help="disaggregated's split in every case (search: sim/split.py, many runs per case)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--measured", help="this machine's costs instead of a preset's: bench/placements.py's --json output")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    if args.measured and args.preset == "paper":
        raise SystemExit("--preset paper is the paper's H20 figures; --measured replays this machine's")
    base = preset(load(), args.preset)
    hardware = "h20" if args.preset == "paper" else "h200"
    k = (2 if args.preset == "paper" else 0) if args.max_staleness is None else args.max_staleness
    groups = ["cpu"] if args.measured else list(base["groups"]) if args.model_group == "all" else [args.model_group]
    for group in groups:
        if not args.measured and group not in base["groups"]:
            raise SystemExit(f"--model-group {group}: the {args.preset} preset has {', '.join(base['groups'])} or all")
    cases = args.cases.split(",")
    for name in cases:
        if name not in CASES:
            raise SystemExit(f"--cases {name}: pick from {', '.join(CASES)}")
        if args.measured and CASES[name][1]:
            raise SystemExit(f"--cases {name}: it changes the {args.preset} preset's figures, which --measured "
                             f"does not use; pick cases that change the rounds alone")
    if args.gpus is None:
        args.gpus = json.loads(Path(args.measured).read_text())["nproc"] if args.measured else 128
    sim_args = argparse.Namespace(calibration="cpu" if args.measured else "h200", measured=args.measured,
                                  preset=args.preset, prompts=None, steps=args.steps,
                                  max_staleness=k, updates="ready", search_split=args.split == "search", timeline=None)
    report = {}
    (clo, chi), (dlo, dhi) = PAPER["over_colocated"], PAPER["over_disaggregated"]
    where = "this machine" if args.measured else f"{args.preset} preset"
    print(f"{args.gpus} devices, {where}; paper: pivot@2/colocated@0 {clo}-{chi}, pivot@2/disaggregated@2 {dlo}-{dhi}")
    print(f"{'group':<30}{'case':<22}{f'pivot@{k}/coloc@0':>17}{f'/disagg@{k}':>12}{f'/bound':>8}{'coloc idle':>11}"
          f"{'pivot waits':>12}  colocated's step: rollout / judge tail / train tail")
    for group in groups:
        for name in cases:
            asks, factors, changes = CASES[name]
            factors = {path.format(hw=hardware): factor for path, factor in factors.items()}
            r = simulate(case_calibration(base, factors), group, args.gpus, sim_args, changes, seed=args.seed)
            coloc, pivot = r["placements"]["colocated@0"], r["placements"][f"pivot@{k}"]
            phases = coloc["phases_s"]
            total = sum(phases.values())
            split = " / ".join(f"{v / total:.0%}" for v in phases.values())
            waits = pivot["slot_seconds"]["waiting"] / sum(pivot["slot_seconds"].values())
            ratios = r[f"pivot{k}_over_colocated0"], r[f"pivot{k}_over_disaggregated{k}"], r[f"pivot{k}_over_bound"]
            disagg = "-" if ratios[1] is None else f"{ratios[1]:.2f}x"  # --measured without a split: none
            print(f"{group:<30}{name:<22}{ratios[0]:>16.2f}x{disagg:>12}{ratios[2]:>7.2f}x"
                  f"{1 - coloc['busy_fraction']:>11.0%}{waits:>12.0%}  {split}", flush=True)
            report.setdefault(group, {})[name] = {
                "asks": asks, f"pivot{k}_over_colocated0": ratios[0], f"pivot{k}_over_disaggregated{k}": ratios[1],
                f"pivot{k}_over_bound": ratios[2], "pivot0_over_colocated0": r["pivot0_over_colocated0"],
                "colocated_idle_fraction": 1 - coloc["busy_fraction"], "colocated_phases_s": phases,
                "pivot_busy_fraction": pivot["busy_fraction"], "pivot_waiting_fraction": waits,
                "shifts": pivot["shifts"]}
    if args.json:
        result_files.write(args.json, {"gpus": args.gpus, "preset": args.preset, "measured": args.measured,
                                       "max_staleness": k, "cases": report})


if __name__ == "__main__":
    main()
