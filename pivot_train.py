"""PivotRL: GRPO post-training of an LLM policy whose reward comes from a generative reward model.

Each step: the policy samples G responses for each of P prompts (vLLM); the judge (the generative reward
model, GenRM) writes a critique of every response and ends it with a verdict, parsed into the reward;
a GRPO update of the policy (FSDP2) uses group-normalised advantages and the clipped ratio objective
against the sampling logprobs; the new weights are published to the Global Parameter Storage and every
rollout engine loads them before the next step. By default synchronous and on-policy: step k's samples
come from step k's weights.

With --max-staleness K > 0 the update runs D steps behind the rollout (D = K, or K - 1 under --updates
ready at K >= 2: pipeline.depth): while step k's prompts are rolled out and judged (with the weights of
update k - D), the train ranks work through the groups of step k - D (all judged), so training overlaps
rollout and judging, and once through them they make the update before the step's last critique and
publish it at once: the sequences in flight go on under the new weights (partial rollout) and step k + 1
begins beside step k's tail (shifting/scheduler.py). Under --updates ready (the default at K >= 2) step
k's rounds then end once at most half of its groups are still out and every group carried into it is
judged; those still out go on in step k + 1 and train with its groups, an update later (shifting/book.py
Book.may_end).
Every sample of update u began under weights version u - K or newer (the first updates: version 0). The clipped ratio against the sampling
logprobs bounds how far the update moves from the weights that sampled them; --rollout-is token|sequence
instead takes verl's rollout correction: the ratio against pi_old, the logprobs of the weights the update
starts from, and each token's loss weighted by min(pi_old / pi_rollout, --rollout-is-threshold).

Where the update departs from textbook GRPO (Shao et al. 2024, arXiv:2402.03300):
  - the reward is the judge's alone by default; --reward adds rule sources with coefficients (an exact
    match with the reference, a well-formed answer, DAPO's overlong penalty over --overlong-buffer tokens;
    algorithm.py, where every change of the algorithm goes: docs/algorithm.md);
  - token-level normalisation: the loss is summed over every response token of a minibatch and divided
    by their count, not averaged per response and then over responses (long responses weigh more);
    --loss-agg seq-mean-token-mean is the textbook mean of response means, seq-mean-token-sum the mean
    of response sums (verl's loss_agg_mode names; early training keeps each exact);
  - the ratio is clipped to [1 - --clip-eps, 1 + --clip-eps-high] (default: --clip-eps; DAPO's
    clip-higher, arXiv:2503.14476, uses 0.2 and 0.28);
  - the learning rate is constant, or warms up linearly over the first --lr-warmup-steps optimizer
    steps (lr / N at the first);
  - the ratio is taken against the engine's sampling logprobs (vLLM's, at the sampling temperature),
    not against logprobs the trainer recomputes; `logprob_gap_mean`/`_max` in the metrics say how far
    apart the two are;
  - no KL term by default (--kl-coef 0); with one, the k3 estimator to the initial policy per token;
  - the log-ratio is clamped to [-20, 20] before exp (as verl does);
  - dual clip: with a negative advantage A a token's loss is at most -C*A (--clip-ratio-c 3; 0: off);
  - advantages (r - mean) / (std + 1e-6) per group, unbiased std (--no-norm-adv-by-std: r - mean, Dr. GRPO's);
    a group of equal rewards adds nothing;
  - AdamW (--adam-betas 0.9,0.99), gradient norm clipped to --grad-clip; an optimizer step whose
    gradient norm is not finite is skipped (counted as `skipped_updates`), and --max-bad-steps of them
    in a row stop the run;
  - with --minibatches N > 1, minibatches after the first are trained on by weights that did not
    sample them (the clipped ratio bounds how far they move);
  - with --max-staleness K > 0, samples K updates old (above); --rollout-is for verl's rollout correction;
  - with --filter-groups (DAPO's dynamic sampling, arXiv:2503.14476, section 3.2), groups whose G rewards
    are all equal leave the update, and the step draws more prompts while it runs until it has
    --prompts-per-step informative groups, or --filter-groups-max-prompts drawn (then it trains those it
    has; verl's filter_groups stops the run at its max_num_gen_batches instead).

On CPU, the built-in task (the defaults):
    torchrun --standalone --nproc_per_node=2 pivot_train.py --out runs/arith
Across GPU nodes, on each node:
    torchrun --nnodes=4 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        pivot_train.py --policy /models/policy --judge-model /models/judge --data train.jsonl \\
        --eval-data eval.jsonl --judge-template judge.txt --out /runs/exp1
(a model that one GPU cannot hold, such as a 72B policy: add --engine-tp 8, engines of 8 GPUs each).
Checking a configuration for 128 ranks first, without torchrun and without loading any weights:
    python pivot_train.py --dry-run --world-size 128 --policy /models/policy --judge-model /models/judge ...
"""
import os

# Before torch loads: large host tensors on 2 MiB transparent huge pages. An onload fills freshly
# allocated memory, and on 4 KiB pages the page faults, not the copy, set its speed.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import argparse
import collections
import gc
import importlib.util
import json
import math
import string
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import algorithm
import checkpoint
import export
import faults
import pipeline
import report
from planner import parse_split
from algorithm import NEEDS_REFERENCE, Recipe, group_advantages, matches_reference
from roles import ENGINE_ROLES, Role, logs
from roles.engine import ENGINE_OVERHEAD_MB
from roles.judge import JUDGE_KINDS, PARSE_RULES, Judge, fill_template
from roles.rollout import RolloutEngine, Sample
from roles.trainer import PolicyTrainer
from runtime import Dist, busy_fraction, cpu_ticks, init_distributed, init_slots, shutdown_distributed
from shifting import book
from shifting.context import RoleContext
from shifting.placement import Placement, PlacementOptions
from shifting.scheduler import SamplingOptions, StepQueues, generate, publish_update
from storage import ParameterStorage, TrainState, checkpoint_storage
from tasks import longtail
from tasks.dataset import DataError, encode_prompt, fit_to_length, load_records, split_heldout, stream_prompts
from timeline import Timeline

HERE = Path(__file__).resolve().parent


def parse_args(argv=None):
    return build_parser().parse_args(argv)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help gives each flag's default, except where its help says what the default is (one worked out
    from other flags)."""

    def _get_help_string(self, action):
        return action.help if "default:" in (action.help or "") else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    g = p.add_argument_group("model and data")
    g.add_argument("--policy", default=str(HERE / "models/arith-policy"), help="HF directory of the policy")
    g.add_argument("--judge-model", default=str(HERE / "models/arith-genrm"), help="HF directory of the judge")
    g.add_argument("--max-model-len", type=int, default=256,
                   help="prompt + response (and judge prompt + critique) tokens; longer prompts are left out")
    g.add_argument("--data", default=str(HERE / "tasks/data/arith_train.jsonl"), help=".jsonl or .parquet")
    g.add_argument("--eval-data", default=str(HERE / "tasks/data/arith_eval.jsonl"), help=".jsonl or .parquet")
    g.add_argument("--eval-split", type=float, default=0.0,
                   help="hold out this fraction of --data (seeded) for evaluation instead of --eval-data")
    g.add_argument("--eval-every", type=int, default=5, help="steps between evaluations")
    g.add_argument("--eval-prompts", type=int, default=200, help="held-out prompts per evaluation")
    g.add_argument("--eval-samples", type=int, default=0, metavar="K",
                   help="also sample K answers to each held-out prompt at --temperature (each seeded) and report "
                        "their mean accuracy, avg@K; 0: greedy answers only")
    g.add_argument("--answer-marker", default=">",
                   help="a response's final answer is the text after the last marker (for eval_accuracy)")
    g = p.add_argument_group("generation")
    g.add_argument("--prompts-per-step", type=int, default=16, help="prompts an update trains (P)")
    g.add_argument("--group-size", type=int, default=8, help="responses sampled per prompt (G), the group GRPO compares")
    g.add_argument("--temperature", type=float, default=1.0,
                   help="the policy samples at it, and the trainer divides its logits by it")
    g.add_argument("--max-response-tokens", type=int, default=64, help="the most tokens a response takes")
    g.add_argument("--filter-groups", action="store_true",
                   help="DAPO's dynamic sampling: leave groups whose G rewards are all equal out of the update, and "
                        "draw more prompts while the step runs until it has --prompts-per-step informative groups")
    g.add_argument("--filter-groups-max-prompts", type=int, default=None, metavar="N",
                   help="with --filter-groups: the most prompts a step draws (default: 4 x --prompts-per-step); a "
                        "step that draws them all trains the informative groups it has")
    g.add_argument("--workload", choices=["task", "longtail"], default="task",
                   help="task: the data's prompts, answered and judged as the models write; longtail: a throughput "
                        "workload, each response and critique generated to a drawn length (log-normal, p99 at "
                        "the token budget, median a tenth of it); its rewards mean nothing")
    g = p.add_argument_group("judge model")
    g.add_argument("--judge-template", default=str(HERE / "tasks/judge_arith.txt"),
                   help="text file with {prompt}, {response} and optionally {reference}; {rubric} for a rubric judge")
    g.add_argument("--judge-kind", choices=JUDGE_KINDS, default="verdict",
                   help="verdict: the judge ends with 'verdict: correct|wrong'; rubric: it scores the example's "
                        "rubric and ends with 'score: N' (1-10)")
    g.add_argument("--max-critique-tokens", type=int, default=96, help="the most tokens a critique takes")
    g.add_argument("--on-parse-failure", choices=PARSE_RULES, default="fail",
                   help="a critique with no verdict: score 0 (fail), judge once more (retry), or stop")
    algorithm.add_flags(p)
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=float, default=2e-4,
                   help="AdamW's learning rate (the built-in task's held-out accuracy wanders back down at 5e-4)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW's decoupled weight decay")
    g.add_argument("--grad-clip", type=float, default=1.0, help="the largest gradient norm an update takes")
    g.add_argument("--lr-warmup-steps", type=int, default=0,
                   help="warm the learning rate up linearly over this many optimizer steps (lr / N at the "
                        "first); 0: constant")
    g.add_argument("--minibatches", type=int, default=1, help="optimizer steps per RL step")
    g.add_argument("--adam-betas", default="0.9,0.99", help="AdamW's beta1,beta2")
    g.add_argument("--max-bad-steps", type=int, default=3,
                   help="stop after this many optimizer steps in a row skipped for a non-finite gradient norm")
    g.add_argument("--micro-batch", type=int, default=32, help="samples per forward pass")
    g.add_argument("--micro-batch-tokens", type=int, default=0,
                   help="also cap a forward pass at this many prompt+response tokens, padded to its longest "
                        "sample (a longer sample goes alone); 0: --micro-batch alone")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="keep only each decoder layer's input for backward and recompute the layer there")
    g = p.add_argument_group("placement and scheduling")
    g.add_argument("--placement", choices=["colocated", "disaggregated", "pivot"], default="colocated",
                   help="colocated: every rank rolls out, then judges, then trains; disaggregated: a fixed "
                        "--split of ranks per role; pivot: the planner moves ranks between roles as the step runs")
    g.add_argument("--split", default=None,
                   help="disaggregated: slots (ranks, or --engine-tp ranks each) per role in rank order, e.g. "
                        "rollout=2,judge=1,train=1")
    g.add_argument("--engine-tp", type=int, default=1, metavar="T",
                   help="ranks per rollout and judge engine (vLLM tensor parallel), of one node: T divides the ranks "
                        "per node; a slot of T ranks is what the planner moves and --split counts; train stays FSDP2 "
                        "over the train slots' ranks")
    g.add_argument("--force-shifts", type=int, default=None, metavar="SEED",
                   help="replace the plan by a seeded random schedule of moves between engine steps, to "
                        "exercise sequence migration and role shifts on your own setup")
    g.add_argument("--force-shift-rate", type=float, default=0.2,
                   help="with --force-shifts, the chance of a move at each engine step")
    g.add_argument("--kv-cache-mb", type=int, default=64,
                   help="KV cache of the policy's engine on each of its ranks, MiB")
    g.add_argument("--judge-kv-cache-mb", type=int, default=None,
                   help="KV cache of the judge's engine on each of its ranks, MiB (default: --kv-cache-mb); on GPU "
                        "it stays on the device for the whole run, beside whatever the rank does")
    g.add_argument("--engine-overhead-mb", type=int, default=ENGINE_OVERHEAD_MB,
                   help="GPU: what each engine takes beyond its weights and KV cache (activations, CUDA graphs); "
                        "an engine starts only where its weights, KV cache and this are free")
    g.add_argument("--max-seqs", type=int, default=64,
                   help="sequences in flight per engine (at K = 0 a pivot judge engine takes fewer while the "
                        "rollout ranks are still to join it: docs/step.md)")
    g.add_argument("--max-staleness", type=int, default=0, metavar="K",
                   help="the update may train samples that weights up to K versions older sampled: it runs K steps "
                        "behind the rollout, overlapping it; 0: synchronous on-policy")
    g.add_argument("--updates", choices=pipeline.UPDATES, default="ready",
                   help="at --max-staleness K >= 2, which groups an update trains: ready, those judged first, each "
                        "within K updates of the weights that began it (a step's slowest groups go on into the "
                        "next update); step, exactly one step's, waiting for its slowest group (the same at K < 2)")
    g.add_argument("--round-steps", type=int, default=book.ROUND_STEPS,
                   help="ranks report to rank 0 about every this many engine steps (measured as time), or when "
                        "their engine runs empty; colocated ranks with nothing queued report once their engine is empty")
    g = p.add_argument_group("run and logging")
    g.add_argument("--trace-rounds", action="store_true",
                   help="rank 0 writes every round's reports and orders to OUT/rounds.jsonl, a line per step rolled "
                        "out, appended (python -m sim.replay replays them through the simulator's rules)")
    g.add_argument("--steps", type=int, default=30, help="RL steps (updates) of the run")
    g.add_argument("--checkpoint-every", type=int, default=0,
                   help="steps between checkpoints in OUT/checkpoints (and one after the last step); the same "
                        "command again resumes")
    g.add_argument("--seed", type=int, default=0,
                   help="the data order, every sample's sampling seed and a forced shift schedule come from it")
    g.add_argument("--out", default="runs/latest", help="the run's folder; a run there with checkpoints resumes")
    g.add_argument("--wandb-project", default=None, metavar="NAME",
                   help="also log the metrics to this Weights & Biases project (needs wandb installed; "
                        "WANDB_MODE=offline logs without a network)")
    g.add_argument("--verbose", action="store_true",
                   help="also show vLLM's progress notes and the warnings known to be harmless here (roles/logs.py)")
    g = p.add_argument_group("dry run", "check a configuration for many ranks without torchrun")
    g.add_argument("--dry-run", action="store_true",
                   help="check the configuration for --world-size ranks and print each role's memory; loads no weights")
    g.add_argument("--world-size", type=int, default=None, help="with --dry-run: the ranks to plan for")
    g.add_argument("--nproc-per-node", type=int, default=8, help="with --dry-run: ranks (devices) per node")
    g.add_argument("--device-memory-gib", type=float, default=None,
                   help="with --dry-run: fail if a device would need more than this")
    return p


# Every numeric flag: (flag, what a usable value satisfies, the rule and why, as the error says it).
NUMBER_RULES = [
    ("max_model_len", lambda v: v >= 2, "at least 2: a prompt token and a response token"),
    ("eval_split", lambda v: 0 <= v < 1, "in [0, 1): the fraction of --data held out (0: use --eval-data)"),
    ("eval_every", lambda v: v >= 1, "at least 1 (steps between evaluations)"),
    ("eval_prompts", lambda v: v >= 1, "at least 1 (held-out prompts per evaluation)"),
    ("eval_samples", lambda v: v >= 0, "0 or more (answers sampled per held-out prompt for avg@K; 0: greedy only)"),
    ("prompts_per_step", lambda v: v >= 1, "at least 1"),
    ("group_size", lambda v: v >= 2, "at least 2: GRPO compares a group's responses"),
    ("temperature", lambda v: v > 0, "above 0: the policy samples at it and the trainer divides its logits by "
                                     "it (1.0 samples the policy as it is)"),
    ("max_response_tokens", lambda v: v >= 1, "at least 1"),
    ("filter_groups_max_prompts", lambda v: v >= 1, "at least 1 (the most prompts a step draws with "
                                                    "--filter-groups, and no fewer than --prompts-per-step)"),
    ("max_critique_tokens", lambda v: v >= 1, "at least 1"),
    ("lr", lambda v: v > 0, "above 0 (AdamW's learning rate, e.g. 2e-4)"),
    ("weight_decay", lambda v: v >= 0, "0 or more (AdamW's decoupled weight decay; 0: none)"),
    ("grad_clip", lambda v: v > 0, "above 0 (the largest gradient norm an update takes, e.g. 1.0)"),
    ("lr_warmup_steps", lambda v: v >= 0, "0 or more (optimizer steps of linear learning-rate warm-up; 0: none)"),
    ("minibatches", lambda v: v >= 1, "at least 1 (optimizer steps per RL step)"),
    ("micro_batch", lambda v: v >= 1, "at least 1 (samples per forward pass)"),
    ("micro_batch_tokens", lambda v: v >= 0, "0 or more (tokens per forward pass; 0: --micro-batch alone)"),
    ("max_bad_steps", lambda v: v >= 1, "at least 1 (skipped optimizer steps in a row that stop the run)"),
    ("force_shift_rate", lambda v: 0 <= v <= 1, "in [0, 1]: the chance of a forced move at each engine step"),
    ("kv_cache_mb", lambda v: v >= 1, "at least 1 (MiB of the policy engine's KV cache)"),
    ("judge_kv_cache_mb", lambda v: v >= 1, "at least 1 (MiB of the judge engine's KV cache; unset: --kv-cache-mb)"),
    ("engine_overhead_mb", lambda v: v >= 0, "0 or more (MiB an engine takes on a GPU beyond weights and KV cache)"),
    ("engine_tp", lambda v: v >= 1, "at least 1 (ranks per rollout and judge engine)"),
    ("max_seqs", lambda v: v >= 1, "at least 1 (sequences in flight per engine)"),
    ("round_steps", lambda v: v >= 1, "at least 1 (engine steps between reports to rank 0)"),
    ("max_staleness", lambda v: v >= 0, "0 or more (updates by which the rollout may run ahead; 0: on-policy)"),
    ("steps", lambda v: v >= 0, "0 or more"),
    ("checkpoint_every", lambda v: v >= 0, "0 or more (0: no checkpoints)"),
    ("seed", lambda v: v >= 0, "0 or more (numpy's seed sequences take no negative seed)"),
    ("world_size", lambda v: v >= 1, "at least 1 (the ranks --dry-run plans for)"),
    ("nproc_per_node", lambda v: v >= 1, "at least 1 (ranks per node, for --dry-run)"),
    ("device_memory_gib", lambda v: v > 0, "above 0 (GiB of one device, for --dry-run)"),
]


def check_config(args) -> tuple[str, PlacementOptions]:
    """Template text and the placement's options, after every check that can fail before anything is built."""
    for flag in ("policy", "judge_model"):
        if not (Path(getattr(args, flag)) / "config.json").is_file():
            sys.exit(f"--{flag.replace('_', '-')} {getattr(args, flag)}: no config.json there; pass a Hugging Face "
                     f"model directory")
    for flag, holds, rule in NUMBER_RULES + algorithm.number_rules():
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and holds(value)):
            sys.exit(f"--{flag.replace('_', '-')} must be {rule}; got {value}")
    if not args.answer_marker:
        sys.exit("--answer-marker must not be empty: eval_accuracy reads the answer after its last occurrence")
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        sys.exit(f"--wandb-project {args.wandb_project}: wandb is not installed: pip install wandb (WANDB_MODE=offline "
                 f"logs without a network), or leave --wandb-project out")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        sys.exit(f"--out {args.out} is a file: pass a directory for the run's files")
    adam_betas(args.adam_betas)
    recipe = reward_recipe(args)
    if "overlong" in dict(recipe.coefficients) and not 1 <= args.overlong_buffer <= args.max_response_tokens:
        sys.exit(f"--reward {args.reward} has overlong, which needs --overlong-buffer N from 1 to "
                 f"--max-response-tokens ({args.max_response_tokens}); got {args.overlong_buffer}")
    if args.prompts_per_step * args.group_size < args.minibatches:
        sys.exit("--minibatches cannot exceed the samples of a step (--prompts-per-step x --group-size)")
    check_filter_groups(args)
    if args.dry_run != (args.world_size is not None):
        sys.exit("--dry-run and --world-size N go together: the dry run plans for N ranks")
    try:
        template = Path(args.judge_template).read_text()
    except OSError as e:
        sys.exit(f"--judge-template {args.judge_template}: {e.strerror}")
    world_size = args.world_size if args.dry_run else int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's
    placement_options = check_placement(args, world_size)
    if "{prompt}" not in template or "{response}" not in template:
        sys.exit(f"--judge-template {args.judge_template} must contain {{prompt}} and {{response}}")
    if args.judge_kind == "rubric" and "{rubric}" not in template:
        sys.exit(f"--judge-template {args.judge_template} has no {{rubric}}, which a rubric judge shows the judge "
                 f"(see tasks/judge_rubric.txt)")
    if os.environ.get("PIVOT_KILL"):
        try:
            faults.parse(os.environ["PIVOT_KILL"])
        except ValueError as e:
            sys.exit(str(e))
    return template, placement_options


def slot_size(args) -> int:
    """The ranks of a slot: every rollout and judge engine spans --engine-tp ranks (book.slot_shape, which the
    simulator's slots follow too)."""
    return book.slot_shape({role: args.engine_tp for role in ENGINE_ROLES})[0]


def check_placement(args, world_size: int) -> PlacementOptions:
    """The options of the placement (shifting/placement.py), a disaggregated run's --split parsed for the
    slots (--engine-tp ranks each) of `world_size` ranks."""
    if world_size % slot_size(args):
        sys.exit(f"--engine-tp {args.engine_tp} does not divide the world's {world_size} ranks: an engine spans "
                 f"--engine-tp ranks of one node; pass an --engine-tp that divides the ranks per node")
    split = None
    if args.placement == "disaggregated":
        if not args.split:
            sys.exit("--placement disaggregated needs --split, e.g. --split rollout=2,judge=1,train=1")
        try:
            split = tuple(parse_split(args.split, world_size // slot_size(args), slot_size(args)))
        except ValueError as e:
            sys.exit(str(e))
        if Role.TRAIN not in split:
            sys.exit(f"--split {args.split} has no train rank: add train=1 (disaggregated needs 3 ranks or more)")
    elif args.split:
        sys.exit(f"--split applies to --placement disaggregated only (this run is {args.placement})")
    return PlacementOptions(placement=args.placement, split=split, max_staleness=args.max_staleness,
                            force_shifts=args.force_shifts, force_shift_rate=args.force_shift_rate,
                            minibatches=args.minibatches, max_seqs=args.max_seqs,
                            max_response_tokens=args.max_response_tokens,
                            max_critique_tokens=args.max_critique_tokens, seed=args.seed)


def sampling_options(args) -> SamplingOptions:
    """How the steps' responses are sampled (shifting/scheduler.py's StepQueues), from flags check_config
    has checked."""
    return SamplingOptions(group_size=args.group_size, seed=args.seed, temperature=args.temperature,
                           max_response_tokens=args.max_response_tokens, workload=args.workload)


def check_filter_groups(args) -> None:
    """--filter-groups and its cap only where the step that draws the prompts is the step that trains them."""
    if args.filter_groups_max_prompts is not None and not args.filter_groups:
        sys.exit("--filter-groups-max-prompts applies with --filter-groups only: add it, or leave the cap out")
    if not args.filter_groups:
        return
    if args.max_staleness:
        sys.exit(f"--filter-groups does not work with --max-staleness {args.max_staleness}: it draws prompts while "
                 f"the step they are trained in rolls out, and at K > 0 the update trains a step rolled out K steps "
                 f"earlier, which the pipeline and its checkpoints do not hold filtered; use --max-staleness 0")
    if step_draw(args) < args.prompts_per_step:
        sys.exit(f"--filter-groups-max-prompts must be at least --prompts-per-step ({args.prompts_per_step}): a "
                 f"step draws those before it leaves any group out; got {args.filter_groups_max_prompts}")


def step_draw(args) -> int:
    """The most prompts a step draws: --prompts-per-step, or with --filter-groups its cap, by default four
    times as many (verl's filter_groups.max_num_gen_batches caps the same draw, in batches)."""
    if not args.filter_groups:
        return args.prompts_per_step
    return 4 * args.prompts_per_step if args.filter_groups_max_prompts is None else args.filter_groups_max_prompts


def reward_recipe(args) -> Recipe:
    try:
        return algorithm.from_args(args).recipe(args.answer_marker, args.max_response_tokens)
    except ValueError as e:
        sys.exit(str(e))


def adam_betas(text: str) -> tuple[float, float]:
    try:
        betas = tuple(float(b) for b in text.split(","))
    except ValueError:
        betas = ()
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        sys.exit(f"--adam-betas {text}: pass two numbers in [0, 1) separated by a comma, e.g. 0.9,0.99")
    return betas


def load_tokenizer(args, flag: str):
    """The tokenizer of --policy or --judge-model, after reading the model's config: an unreadable directory
    fails here, before any work, rather than deep inside an engine."""
    from transformers import AutoConfig, AutoTokenizer
    path = getattr(args, flag)
    try:
        AutoConfig.from_pretrained(path)
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        sys.exit(f"--{flag.replace('_', '-')} {path}: cannot read it as a Hugging Face model ({reason}); pass a directory with its "
                 f"config.json, tokenizer files and weights as save_pretrained writes them")


def check_tokenizers(args, template: str, policy_tok, judge_tok) -> None:
    """The judge's tokenizer must be able to write its template's text and the final line the parser
    reads, and end a critique; the policy's must be able to write --answer-marker."""
    if judge_tok.eos_token_id is None:
        sys.exit(f"--judge-model {args.judge_model}: its tokenizer has no end-of-sequence token, so every critique "
                 f"would run to --max-critique-tokens: set eos_token in its tokenizer_config.json")
    final = "score: 10" if args.judge_kind == "rubric" else "verdict: correct verdict: wrong"
    literal = "".join(text for text, *_ in string.Formatter().parse(template))
    for tok, flag, what, text in ((judge_tok, "--judge-model", f"--judge-template {args.judge_template}", literal),
                                  (judge_tok, "--judge-model", f"the {args.judge_kind} line the parser reads", final),
                                  (policy_tok, "--policy", "--answer-marker", args.answer_marker)):
        lost = [c for c in sorted(set(text)) if c not in tok.decode(tok(c, add_special_tokens=False).input_ids)]
        if lost:
            sys.exit(f"{flag} {getattr(args, flag[2:].replace('-', '_'))}: its tokenizer cannot write "
                     f"{' '.join(map(repr, lost))} of {what}: rewrite it without them, or use a tokenizer that has them")


def load_data(args, template: str, policy_tok, judge_tok) -> tuple[list[dict], list[dict], dict]:
    """Training and evaluation records that fit the length limit, tokenized, and what was left out."""
    try:
        train_set = load_records(args.data)
        if args.eval_split > 0:
            train_set, eval_set = split_heldout(train_set, args.eval_split, args.seed)
        else:
            eval_set = load_records(args.eval_data)
    except DataError as e:
        sys.exit(str(e))
    if args.judge_kind == "rubric":
        missing = sum(not r["rubric"] for r in train_set + eval_set)
        if missing:
            sys.exit(f'{missing} records have no "rubric", which --judge-kind rubric shows the judge: '
                     f"add one to every record, or use --judge-kind verdict")
    for source in set(NEEDS_REFERENCE) & set(dict(reward_recipe(args).coefficients)):
        missing = sum(r["reference"] is None for r in train_set + eval_set)
        if missing:
            sys.exit(f'--reward {args.reward}: {source} compares each answer with its record\'s "reference", and '
                     f"{missing} records have none: add one to every record, or leave {source} out of --reward")

    def judge_ids(r):  # the judge's prompt for r, with an empty response
        return encode_prompt(judge_tok, fill_template(template, r["prompt"], "", r["reference"], r["rubric"]))

    limits = dict(max_model_len=args.max_model_len, response_tokens=args.max_response_tokens,
                  critique_tokens=args.max_critique_tokens)
    train_fit, train_long = fit_to_length(train_set, policy_tok, judge_ids, **limits)
    eval_fit, eval_long = fit_to_length(eval_set, policy_tok, judge_ids, **limits)
    if not train_fit:
        sys.exit(f"all {len(train_set)} training prompts are over --max-model-len {args.max_model_len} with "
                 f"--max-response-tokens and --max-critique-tokens: raise the first or lower the others")
    info = {"train_prompts": len(train_fit), "train_prompts_too_long": train_long,
            "eval_prompts": min(len(eval_fit), args.eval_prompts), "eval_prompts_too_long": eval_long,
            "policy_chat_template": bool(policy_tok.chat_template),
            "judge_chat_template": bool(judge_tok.chat_template)}
    return train_fit, eval_fit[:args.eval_prompts], info


def main(argv=None):
    args = parse_args(argv)
    logs.configure(args.verbose)
    template, placement_options = check_config(args)
    policy_tok, judge_tok = load_tokenizer(args, "policy"), load_tokenizer(args, "judge_model")
    check_tokenizers(args, template, policy_tok, judge_tok)
    train_set, eval_set, data_info = load_data(args, template, policy_tok, judge_tok)
    if args.dry_run:
        import dryrun
        print(data_line(data_info, args))
        dryrun.print_sizing(dryrun.sizing(args, placement_options))
        return
    out = Path(args.out)
    resume, again = checkpoint.latest(out), (out / "config.json").exists()
    if resume or (out / "metrics.jsonl").exists():
        # A run killed before its first checkpoint starts over; one that never checkpoints is not overwritten.
        if resume is None and not (args.checkpoint_every and again):
            sys.exit(f"--out {out} holds a run with no checkpoint to resume from: pass a new --out directory "
                     f"(and --checkpoint-every K to make runs resumable)")
        changed = checkpoint.differing_flags(json.loads((out / "config.json").read_text()), args,
                                             vars(build_parser().parse_args([])))
        if changed:
            sys.exit(f"--out {out} holds a run with other settings, so it cannot resume: " + "; ".join(changed))
    d = init_distributed()
    timeline = Timeline(d, out)
    checkpoint.every_node_sees(d, out, resume)
    start = resume["steps_done"] if resume else 0
    if d.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(vars(args), indent=2))
        (out / "run_info.json").write_text(json.dumps(data_info, indent=2))
        print(data_line(data_info, args))
        if args.workload == "longtail":
            print(longtail.LABEL)
        if again:
            print(f"resuming from {resume['folder']} after step {start - 1}" if resume else
                  f"--out {out} has no checkpoint yet: starting over")
            forget_after(out, start)

    on_gpu = d.device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    init_slots(d, slot_size(args))
    placement, sampling = Placement(placement_options, d.slots), sampling_options(args)
    algo = algorithm.from_args(args)
    train_state = TrainState(d, args.policy, keep_reference=algo.keeps_reference, keep_grads=placement.early_train)
    storage = ParameterStorage(d, "policy", train_state.weight_shapes(dtype))
    if resume:
        checkpoint.restore(d, resume, train_state)
    train_state.publish_weights(storage, version=start)
    judge_storage = checkpoint_storage(d, Role.JUDGE, args.judge_model, dtype)
    # Both engines' weights come from storage. On GPU the policy's engine is the process's one sleep-mode
    # engine (it starts asleep); the judge's keeps its weights and KV cache on the device (README, "GPUs
    # and several nodes").
    engines = dict(from_storage=True, overhead_bytes=args.engine_overhead_mb << 20, tensor_parallel=args.engine_tp)
    rollout_engine = RolloutEngine(args.policy, policy_tok, seed=args.seed, max_model_len=args.max_model_len,
                                   kv_cache_bytes=args.kv_cache_mb << 20, sleep_mode=True, **engines)
    judge = Judge(args.judge_model, judge_tok, template, seed=args.seed, max_model_len=args.max_model_len,
                  kv_cache_bytes=(args.judge_kv_cache_mb or args.kv_cache_mb) << 20,
                  max_tokens=args.max_critique_tokens, on_parse_failure=args.on_parse_failure,
                  encode_prompt=encode_prompt, judge_kind=args.judge_kind, recipe=reward_recipe(args),
                  lengths=longtail.lengths(args.workload, args.seed, longtail.CRITIQUE, args.max_critique_tokens),
                  **engines)
    if resume:
        placement.load_state(resume["planner"])
    hyper = dict(algorithm=algo, lr=args.lr, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                 temperature=args.temperature, micro_batch=args.micro_batch,
                 micro_batch_tokens=args.micro_batch_tokens, activation_checkpointing=args.activation_checkpointing,
                 adam_betas=adam_betas(args.adam_betas), lr_warmup_steps=args.lr_warmup_steps)
    context = RoleContext(d, placement.start_roles(), policy=storage, judge=judge_storage,
                          train_state=train_state, rollout_engine=rollout_engine.engine, judge_engine=judge.engine,
                          make_trainer=lambda group: PolicyTrainer(train_state, group, d.device, **hyper),
                          observer=timeline)
    board = tensorboard_writer(d, out, args)

    timeline.begin_step(start)
    # The engines load the stored version (a resumed run's weights); the first record says so.
    startup = {"startup_shifts": context.apply(placement.start_roles())}
    timeline.started()
    skipped_in_row = 0
    clock = (time.perf_counter(), start)  # when and at which step this launch began
    # --max-staleness K: the steps generated and judged whose updates are still to come (K of them once
    # the pipeline is full), oldest first.
    pending = collections.deque(checkpoint.pending_steps(resume) if resume else [])
    check_pending(len(pending), args)
    # Where the data stream stands: the prompts the steps rolled out so far have drawn.
    position = data_position(resume, start, len(pending), args)

    def prompts(step: int, later: int = 0) -> list[dict]:
        """Step `step`'s prompts, or (`later` 1) the next step's, which follow them in the data stream."""
        if step + later >= args.steps:  # the last K updates: nothing left to roll out
            return []
        first = position + later * step_draw(args)  # --filter-groups, which draws more, is refused at K > 0
        return [train_set[i] for i in stream_prompts(len(train_set), first, step_draw(args), args.seed)]

    # --max-staleness K > 0: the next step's work that a step began, once its update was published during
    # it (rank 0 keeps it), and the prompts of the step before, whose groups still out as it ended go on in
    # the next (--updates ready). A checkpoint holds whole steps: a launch begins with neither.
    carried, before = None, []

    def roll_out(step: int, train_pool: list[Sample] | None, ahead: int | None = None):
        """`ahead`: the step that may begin during this one (book.ahead_step), its prompts the next in the
        data stream; None: none."""
        nonlocal position, carried, before
        drawn = prompts(step)
        samples, early, generation, carried = rollout_and_judge(
            d, context, drawn, rollout_engine, judge, placement, step, timeline, args, sampling=sampling,
            algo=algo, train_pool=train_pool, skipped_in_row=skipped_in_row,
            ahead=None if ahead is None else prompts(step, later=1), carried=carried, before=before)
        # --filter-groups (K = 0) draws as it goes: every prompt it admitted yields G samples
        position += len(samples) // args.group_size if args.filter_groups else len(drawn)
        before = drawn
        return samples, early, generation

    for step in range(start, args.steps + 1):
        timeline.begin_step(step)
        record, startup = {"step": step, **startup}, {}
        if step % args.eval_every == 0 or step == args.steps:
            with timeline.busy("eval"):
                record.update(evaluate(d, context, rollout_engine, judge, eval_set, args, step))
        if step == args.steps:  # the last record is the evaluation of the final weights
            log_step(d, out, record, board, args.steps, clock)
            break
        begin, cpu = time.perf_counter(), cpu_ticks()
        samples, trained, early, generation = rollout_for_update(step, pending, roll_out, args)
        record.update(staleness_metrics(trained, step, args.max_staleness))
        shifts, held = generation.pop("shifts"), list(context.roles)  # the roles as the step's rounds ended
        if early["update"] is None:  # else the train ranks made it while the step rolled out
            shifts += to_train(context, placement, early)
        stats = train_step(context, trained, early, timeline, args, algo, skipped_in_row)
        shifts += publish_and_reload(context, storage, placement, held, version=step + 1)
        placement.learn(samples or trained, shifts, stats)
        record.update(step_metrics(trained, stats, time.perf_counter() - begin, args))
        if args.filter_groups:
            record["filter_groups"] = filter_metrics(trained, args)
        record.update(shifts=shifts, **generation, cpu_busy=busy_fraction(cpu, cpu_ticks()))
        record.update(timeline.close_step())
        # Bytes and seconds of the storage's publishes since the last record (weights, training-state saves,
        # gradients carried from an early train group).
        record["storage"] = {"policy": storage.traffic(), "train_state": train_state.state.traffic(),
                             **({"train_grads": train_state.partial.traffic()} if train_state.partial else {})}
        log_step(d, out, record, board, args.steps, clock)
        log_samples(d, out, step, trained, args)
        skipped_in_row = check_skipped_updates(step, stats, args)
        if checkpoint_due(step, args):
            with timeline.busy("checkpoint"):
                checkpoint.save(d, out, step + 1, train_state, context, args.policy, placement.state(),
                                list(pending), data_position=position)

    # The trained policy as a Hugging Face directory, from the state the last update left in storage.
    with timeline.busy("export"):
        train_state.save(context.trainer)
        export.write_model(d, train_state, args.policy, out / "model")
    timeline.draw()
    if d.rank == 0:
        board.close()
        report.finish(out)
    for held in (storage, judge_storage, train_state):
        held.close()
    context = rollout_engine = judge = None  # the engines must go before the process group they use
    gc.collect()
    shutdown_distributed(d)


def check_pending(pending: int, args) -> None:
    """A resumed run's checkpoint holds `pending` steps rolled out ahead: no more than its pipeline's depth
    (one written by step-locked updates at K >= 2, before --updates existed, holds K)."""
    if pending > pipeline.depth(args.max_staleness, args.updates):
        sys.exit(f"--out {args.out}: its checkpoint holds {pending} steps rolled out ahead of the update, as "
                 f"step-locked updates keep them; resume it with --updates step")


def checkpoint_due(step: int, args) -> bool:
    """Whether update `step` ends in a checkpoint."""
    return bool(args.checkpoint_every) and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps)


def data_position(resume: dict | None, start: int, pending: int, args) -> int:
    """Where a launch takes up the data stream: at its start, or where the checkpoint says it stood
    (one written before it said so: after the steps done and `pending`, each of --prompts-per-step)."""
    if resume is None:
        return 0
    return resume.get("data_position", (start + pending) * args.prompts_per_step)


# What the steps rolled out before the first update (--max-staleness K > 0) add to its record.
FILL_COUNTS = ("judge_requests", "judge_parse_failures", "migrated_sequences", "migration_prefill_tokens",
               "rollout_judge_s", "rounds", "bound_wait_s", "rollout_idle_s", "spilled_groups")


def rollout_for_update(step: int, pending: collections.deque, roll_out, args):
    """Collective: the samples update `step` trains, and the rollout and judging that ran meanwhile. At
    K = 0 those are step `step`'s, rolled out now. At K > 0 they are the oldest of `pending` (the steps
    rolled out ahead, whose updates are still to come), which the train ranks work through during the
    rounds of step + K, rolled out and judged now and added to `pending`; before the first update the
    first K steps are rolled out with nothing to train (their figures go into this update's). The step
    rolled out beside the update may begin the next (book.ahead_step): not where the update ends in a
    checkpoint. `roll_out(step, train_pool, ahead)` is `rollout_and_judge` for that step, `ahead` the
    step that may begin during it. Returns (the samples rolled out, the samples to train, what early
    training did, the rollout's figures)."""
    fill = {key: 0 for key in FILL_COUNTS} | {"shifts": []}
    depth = pipeline.depth(args.max_staleness, args.updates)
    ahead, beside = pipeline.rollouts(step, len(pending), depth, args.steps)
    for filled_step in ahead:
        filled, _, generation = roll_out(filled_step, None)
        pending.append(filled)
        fill = {key: fill[key] + generation[key] for key in fill}
    pool = pending.popleft() if depth else None
    next_step = book.ahead_step(beside, depth, args.steps, checkpoint_due(step, args))
    samples, early, generation = roll_out(beside, pool, next_step)
    if pool is not None and samples:
        pending.append(samples)
    generation = {**generation, **{key: fill[key] + generation[key] for key in fill}}
    return samples, samples if pool is None else pool, early, generation


def rollout_and_judge(d: Dist, context, prompts, rollout_engine, judge, placement, step, timeline, args, *,
                      sampling: SamplingOptions, algo: algorithm.Algorithm, train_pool: list[Sample] | None = None,
                      skipped_in_row: int = 0, ahead: list[dict] | None = None,
                      carried: StepQueues | None = None, before: list[dict] | None = None):
    """Collective: the step's samples, scored, in (prompt, sample) order on every rank, each with the
    weights' versions that sampled its tokens, and what the step's rollout and judging took (shifts,
    migrations, rounds, the judge's first-try parse failures). With a `train_pool` (an earlier step's
    scored samples) the train ranks work through its groups meanwhile (early training), and once through
    them all make the update (its statistics in the returned `early["update"]`). With `ahead` (the next
    step's prompts) the update is published as soon as it is made, and the next step begins; `carried`
    (rank 0): this step's work, begun so by the step before, with (--updates ready) the groups of that step
    left out as it ended, whose prompts are `before`; this step's end may leave some out so, in turn. Returns
    the samples (this step's and those carried into it), `early`, the figures, and (rank 0) the next step's
    work begun."""
    # At K > 0 a step rolled out before any update (the pipeline's first K) has no groups to train.
    early_train = placement.early_train and (train_pool is not None or not args.max_staleness)
    ahead = ahead if early_train else None
    queues = StepQueues(prompts, step=step, sampling=sampling, algo=algo, round_steps=args.round_steps,
                        ranks=d.slots,
                        early_train=early_train, train_speed=placement.train_speed, train_pool=train_pool,
                        skipped_in_row=skipped_in_row, version=context.storage[Role.ROLLOUT].version,
                        ahead=ahead, carried=carried, trace=args.trace_rounds,
                        spill=pipeline.depth(args.max_staleness, args.updates) < args.max_staleness,
                        filter_groups=args.prompts_per_step if args.filter_groups else None) if d.rank == 0 else None
    start = time.perf_counter()
    samples, early, shifts, resume_s = generate(d, context, queues, placement.next_roles, prompts=prompts,
                                                rollout=rollout_engine, judge=judge, intake=placement,
                                                seed=placement.seed, step=step, timeline=timeline, ahead=ahead,
                                                before=before)
    seconds = time.perf_counter() - start
    if queues is not None and queues.trace is not None:
        with open(Path(args.out) / "rounds.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "samples": len(prompts) * args.group_size, "group_size": args.group_size,
                                "train_pool": train_pool is not None, "early_train": early_train,
                                "ahead": ahead is not None, "carried": carried is not None,
                                "rounds": queues.trace}) + "\n")
    resume = torch.tensor([resume_s])
    dist.all_reduce(resume, group=d.control)
    counts = [(queues.parse_failures, queues.judge_runs, queues.migrated, queues.engine_metrics(),
               queues.train_speed.per_s, queues.reloaded,
               sum(key[0] == queues.ahead.step for key in queues.ahead.samples) if queues.ahead else 0,
               early["update"] is None and placement.update_alone(list(context.roles), queues),
               (queues.bound_wait_s, queues.rollout_idle_s, queues.spilled))
              if queues else None]
    dist.broadcast_object_list(counts, src=0, group=d.control)
    failures, judged, migrated, engines, placement.train_speed.per_s, reloaded, ran_ahead, alone, bound = counts[0]
    early = {**early, "alone": alone}  # who makes the update, if the rounds did not (to_train)
    # What every rank waited for beyond the busiest rank's work (its shift, engine steps, training) and
    # rank 0's choice of roles (plan_s): the rounds' exchange with rank 0.
    exchange = seconds - engines["rounds_work_s"] - engines["plan_s"]
    figures = {"shifts": shifts, "migrated_sequences": migrated,
               "migration_prefill_tokens": sum(s.prefill_tokens for s in samples),
               "migration_prefill_s": resume.item(), "rollout_judge_s": seconds, "exchange_s": exchange,
               "judge_parse_failures": failures, "judge_requests": judged,
               "reloaded_sequences": reloaded, "ran_ahead_samples": ran_ahead, "bound_wait_s": bound[0],
               "rollout_idle_s": bound[1], "spilled_groups": bound[2], **engines}
    return samples, early, figures, queues.ahead if queues else None


def staleness_metrics(samples: list[Sample], update: int, bound: int) -> dict:
    """How many versions older than the update's own weights (`update`) sampled its samples, counted per
    staleness; samples beyond the bound would mean the pipeline is broken, and stop the run."""
    stale = collections.Counter(update - s.version for s in samples)
    if max(stale) > bound or min(stale) < 0:
        raise SystemExit(f"update {update}: samples of weights versions {sorted(update - k for k in stale)} "
                         f"break --max-staleness {bound}")
    tokens = collections.Counter()  # response tokens per staleness of the weights that sampled each
    for s in samples:
        ends = [first for first, _ in s.versions[1:]] + [len(s.response_ids)]
        for (first, version), end in zip(s.versions, ends):
            tokens[update - version] += end - first
    # --updates ready: groups of an earlier step, which its end left out
    return {"staleness": {str(k): n for k, n in sorted(stale.items())},
            "staleness_tokens": {str(k): n for k, n in sorted(tokens.items())},
            "earlier_step_groups": len({s.group for s in samples if s.step < update})}


def to_train(context: RoleContext, placement: Placement, early: dict) -> list[dict]:
    """Collective: the ranks that make this step's update take the train role (the train ranks keep it
    alone where rank 0 found that no slower: `early["alone"]`, Placement.update_alone); returns the shifts."""
    return context.apply(placement.train_roles(list(context.roles), early["alone"]))


def update_samples(samples: list[Sample], algo: algorithm.Algorithm, group_size: int) -> list[Sample]:
    """The samples the update trains (those --filter-groups left in), each with its advantage
    (algorithm.group_advantages, which early training calls too)."""
    samples = [s for s in samples if not s.dropped]
    group_advantages(algo, [samples[i:i + group_size] for i in range(0, len(samples), group_size)])
    return samples


def train_step(context: RoleContext, samples: list[Sample], early: dict, timeline: Timeline, args,
               algo: algorithm.Algorithm, skipped_in_row: int) -> dict:
    """The GRPO update on the ranks that hold the train role; every rank gets its statistics. The groups
    trained early (`early`, pivot) are in the gradients already: the rest complete the update. With
    `early["update"]` the train ranks made it already, during the rollout: its statistics are kept. Groups
    --filter-groups left out are not in it; with none left the update takes no optimizer step."""
    samples = update_samples(samples, algo, args.group_size)
    if early["groups"]:
        early_groups = set(early["groups"])
        minibatches = [[s for s in samples if s.group not in early_groups]]
    else:
        per = max(1, -(-len(samples) // args.minibatches))
        minibatches = [samples[i:i + per] for i in range(0, len(samples), per)]
    stats = early["update"]
    if stats is None and context.trainer is not None:
        start = time.perf_counter()
        with timeline.busy(Role.TRAIN):
            stats = context.trainer.train_step(minibatches, early if early["groups"] else None, skipped_in_row)
        # Prompt and response tokens per second per train rank: what sizes early training's shares.
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for mb in minibatches for s in mb)
        if tokens:  # a step with nothing to train measures nothing
            stats["train_tokens_per_s"] = (tokens / (time.perf_counter() - start)
                                           / dist.get_world_size(context.trainer.group))
    everyone = [None] * context.d.world_size
    dist.all_gather_object(everyone, stats, group=context.d.control)
    stats = next(s for s in everyone if s is not None)
    return {**stats, "early_trained_groups": len(early["groups"]), "early_trained_tokens": early["tokens"],
            "update_during_rollout": early["update"] is not None, "update_alone": early["alone"]}


def check_skipped_updates(step: int, stats: dict, args) -> int:
    """Optimizer steps skipped in a row for a non-finite gradient norm, up to this step's; the run stops
    at --max-bad-steps (on every rank: each holds the same statistics)."""
    if stats["skipped_in_row"] >= args.max_bad_steps:
        raise SystemExit(f"step {step}: {stats['skipped_in_row']} optimizer steps in a row skipped for a non-finite "
                         f"gradient norm (--max-bad-steps {args.max_bad_steps}); the weights are those from before the "
                         f"first of them: lower --lr, or read the step's samples in samples.jsonl")
    return stats["skipped_in_row"]


def publish_and_reload(context: RoleContext, storage: ParameterStorage, placement: Placement, held: list[str],
                       version: int) -> list[dict]:
    """Collective: the new weights go into every node's storage (`publish_update`), unless they went there
    during the rollout; then every rank takes its role for the next step (Placement.step_roles, from those
    it `held` as the step's rounds ended), and the rollout engines load the new version."""
    if storage.version < version:  # else the train ranks published it during the rollout (StepQueues.publish)
        publish_update(context, version)
    return context.apply(placement.step_roles(held))


def evaluate(d: Dist, context, engine: RolloutEngine, judge: Judge, eval_set: list[dict], args, step: int) -> dict:
    """Greedy answers on the held-out prompts, checked against their references, and how often the
    judge's verdict agrees with that check; with --eval-samples K, also avg@K of K answers sampled at
    --temperature. Every rank answers, then every rank judges, each in that role (on GPU the other
    engine is asleep); the ranks then go back to the roles they held."""
    held = list(context.roles)
    shifts = context.apply([Role.ROLLOUT] * d.slots)
    mine = list(range(d.slot, len(eval_set), d.slots))  # every rank of a slot answers the same share
    responses = engine.greedy([eval_set[i]["prompt_ids"] for i in mine], args.max_response_tokens)
    accuracy = sampled_accuracy(d, engine, eval_set, mine, args)
    samples = [Sample(i, 0, eval_set[i]["prompt_ids"], [], [], "eval", response=r,
                      reference=eval_set[i]["reference"], prompt=eval_set[i]["prompt"], rubric=eval_set[i]["rubric"])
               for i, r in zip(mine, responses)]
    shifts += context.apply([Role.JUDGE] * d.slots)
    judge.judge(samples, step)
    shifts += context.apply(held)
    # A judge "says correct" when its reward is at least half (a verdict of correct; a score of 6 or more).
    rows = [(matches_reference(s.response, s.reference, args.answer_marker),
             None if (reward := judge.parse(s.critique)) is None else reward >= 0.5) for s in samples]
    per_rank = [None] * d.world_size
    dist.all_gather_object(per_rank, rows, group=d.control)
    rows = [r for got in per_rank[::d.slot_size] for r in got]
    confusion = {"judge_correct_ref_correct": 0, "judge_correct_ref_wrong": 0,
                 "judge_wrong_ref_correct": 0, "judge_wrong_ref_wrong": 0, "judge_unparsed": 0}
    for correct, verdict in rows:
        ref = "ref_correct" if correct else "ref_wrong"
        key = "judge_unparsed" if verdict is None else f"judge_{'correct' if verdict else 'wrong'}_{ref}"
        confusion[key] += 1
    agree = confusion["judge_correct_ref_correct"] + confusion["judge_wrong_ref_wrong"]
    return {"eval_accuracy": sum(c for c, _ in rows) / len(rows), **accuracy, "judge_agreement": agree / len(rows),
            "judge_confusion": confusion, "eval_shifts": shifts}


def sampled_accuracy(d: Dist, engine: RolloutEngine, eval_set: list[dict], mine: list[int], args) -> dict:
    """Collective, with --eval-samples K: avg@K over the held-out prompts, each rank sampling the K answers
    to its share of them (`mine`) at --temperature; nothing without it."""
    if not args.eval_samples:
        return {}
    sampled = engine.sample([(i, eval_set[i]["prompt_ids"]) for i in mine], args.eval_samples, args.temperature,
                            args.max_response_tokens, args.seed)
    per_rank = [None] * d.world_size
    dist.all_gather_object(per_rank, [(eval_set[i]["reference"], texts) for i, texts in zip(mine, sampled)],
                           group=d.control)
    return {f"eval_accuracy_avg@{args.eval_samples}": avg_at_k([a for got in per_rank[::d.slot_size] for a in got],
                                                                args.answer_marker)}


def avg_at_k(answers: list[tuple[str | None, list[str]]], marker: str) -> float:
    """avg@k (DAPO's avg@32, arXiv:2503.14476; verl's mean@k) of (reference, its k sampled answers) per
    held-out prompt: the mean over prompts of the share of answers that match the reference."""
    shares = [sum(matches_reference(a, ref, marker) for a in texts) / len(texts) for ref, texts in answers]
    return sum(shares) / len(shares)


def step_metrics(samples: list[Sample], stats: dict, seconds: float, args) -> dict:
    response_tokens = sum(len(s.response_ids) for s in samples)
    checked = [s for s in samples if s.reference is not None]
    agree = sum(not s.parse_failed and (s.scores[Role.JUDGE] == 1.0) == matches_reference(s.response, s.reference,
                                                                                         args.answer_marker)
                for s in checked)
    return {"samples": len(samples), "reward_mean": sum(s.reward for s in samples) / len(samples),
            "reward_sources": {name: sum(s.scores[name] for s in samples) / len(samples) for name in samples[0].scores},
            "response_tokens_mean": response_tokens / len(samples), "step_time_s": seconds,
            "samples_per_s": len(samples) / seconds, "tokens_per_s": response_tokens / seconds,
            "judge_parse_unresolved": sum(s.parse_failed for s in samples),
            "judge_agreement_train": agree / len(checked) if checked else None,
            "shifts": [], **stats}


def filter_metrics(samples: list[Sample], args) -> dict:
    """--filter-groups: the prompts the step drew, the groups it left out and those it trained, and
    whether it drew all it may (--filter-groups-max-prompts) with fewer informative groups than
    --prompts-per-step."""
    drawn = len(samples) // args.group_size
    dropped = sum(s.dropped for s in samples) // args.group_size
    return {"prompts_drawn": drawn, "dropped": dropped, "trained": drawn - dropped,
            "capped": drawn == step_draw(args) and drawn - dropped < args.prompts_per_step}


def forget_after(out: Path, start: int) -> None:
    """Drops what a run logged for steps it will do again on resuming (those after its checkpoint)."""
    for name in ("metrics.jsonl", "samples.jsonl", "timeline.jsonl"):
        path = out / name
        if path.exists():
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] < start]
            path.write_text("".join(line + "\n" for line in kept))


def log_samples(d: Dist, out: Path, step: int, samples: list[Sample], args) -> None:
    """Every response of the step with its critique and reward, for reading what the judge rewards;
    with --filter-groups, whether the update trained it; with --max-staleness, the weights' versions
    that sampled its tokens and its group (the step that drew it may be an earlier or a later one)."""
    if d.rank != 0:
        return
    with open(out / "samples.jsonl", "a") as f:
        for s in samples:
            row = {"step": step, "prompt": s.prompt, "response": s.response, "critique": s.critique,
                   "reward": s.reward, "scores": s.scores, "advantage": s.advantage, "reference": s.reference,
                   "prompt_tokens": len(s.prompt_ids), "response_tokens": len(s.response_ids),
                   "judge_prompt_tokens": s.judge_prompt_tokens, "critique_tokens": s.critique_tokens}
            row |= {"trained": not s.dropped} if args.filter_groups else {}
            # (first token, version) per stretch, and its group: the step that drew its prompt, and the prompt's place
            row |= {"versions": s.versions, "group": list(s.group)} if args.max_staleness else {}
            f.write(json.dumps(row) + "\n")


def data_line(info: dict, args) -> str:
    """The data summary every run prints: what was loaded and what the length limit left out."""
    chat = {True: "yes", False: "no"}
    return (f"data: {info['train_prompts']} training prompts, {info['eval_prompts']} held-out; over --max-model-len "
            f"{args.max_model_len} and left out: {info['train_prompts_too_long']} training, "
            f"{info['eval_prompts_too_long']} held-out; chat template: policy {chat[info['policy_chat_template']]}, "
            f"judge {chat[info['judge_chat_template']]}")


def tensorboard_writer(d: Dist, out: Path, args):
    """Rank 0's TensorBoard event file in the run directory (`tensorboard --logdir OUT`), and with
    --wandb-project a Weights & Biases run beside it that gets the same scalars."""
    if d.rank != 0:
        return None
    from tensorboardX import SummaryWriter
    return Board(SummaryWriter(str(out), flush_secs=10), args, out)


class Board:
    """Where rank 0's scalars go: TensorBoard, and Weights & Biases with --wandb-project."""

    def __init__(self, tensorboard, args, out: Path):
        self.tensorboard, self.wandb = tensorboard, None
        if args.wandb_project:
            import wandb
            self.wandb = wandb.init(project=args.wandb_project, name=out.name, dir=str(out), config=vars(args))

    def add(self, record: dict) -> None:
        flat = scalars(record)
        for tag, value in flat.items():
            self.tensorboard.add_scalar(tag, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(flat, step=record["step"])

    def close(self) -> None:
        self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """A metrics record as TensorBoard scalars: nested dicts become "a/b" tags, lists their length."""
    flat = {}
    for key, value in record.items():
        if isinstance(value, dict):
            flat.update(scalars(value, f"{prefix}{key}/"))
        elif isinstance(value, list):
            flat[f"{prefix}{key}"] = float(len(value))
        elif isinstance(value, (int, float)) and key != "step":
            flat[f"{prefix}{key}"] = float(value)
    return flat


def log_step(d: Dist, out: Path, record: dict, board, steps: int, clock: tuple[float, int]) -> None:
    """Rank 0: the record into metrics.jsonl and the boards, and its console lines; `clock`: when and at
    which step this launch began, for the step line's elapsed time and ETA (this launch's mean time per
    step, evaluations included, times the steps left)."""
    if d.rank != 0:
        return
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    board.add(record)
    if "eval_accuracy" in record:
        print(report.eval_line(record), flush=True)
    if "reward_mean" in record:
        elapsed, done = time.perf_counter() - clock[0], record["step"] + 1 - clock[1]
        print(report.step_line(record, steps, elapsed, elapsed / done * (steps - record["step"] - 1)), flush=True)


if __name__ == "__main__":
    main()
