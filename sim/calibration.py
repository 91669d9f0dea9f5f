"""The simulator's cost model, read from calibration.json: every figure there has a value, a unit and a
source, and the loader refuses a file where one lacks any of them, naming the entry.

Two cost models with one surface, which the event engine uses:
  GpuModel  one model group on H200s, derived from public figures: decode is memory-bound (an engine
            step reads the weights it touches, 1/tp of them per GPU, plus every running sequence's KV),
            prefill and training are compute-bound, shifts move bytes over PCIe plus a fixed wake.
  CpuModel  this code on this machine, everything measured by bench/placements.py (its --json) in the
            runs it compares: engine steps against batch, prefill and training rates, shift costs (where
            a pair was not seen there, bench/shift_latency.py's figure in calibration.json), and what a
            round's exchange with rank 0 and rank 0's planning cost. Ranks share few cores here: work
            runs max(1, busy / cores) times slower while `busy` ranks work.
A simulated "slot" is the devices one instance of the widest role needs, so that any slot can hold any
role (a narrower role runs several instances on it).
"""
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from planner import EngineSpeed, LinearFit, Speeds
from roles import ROLES, Role
from shifting import book

CALIBRATION = Path(__file__).with_name("calibration.json")
TEXT_KEYS = {"about", "policy", Role.JUDGE}
CPU_MEASURED = ("cpus", "split", "rollout_step_s", "rollout_per_seq_s", "rollout_prefill_per_s", "judge_step_s",
                "judge_per_seq_s", "judge_prefill_per_s", "train_tokens_per_s_by_ranks", "max_seqs",
                "prompts_per_step", "group_size", "prompt_tokens", "judge_template_tokens", "response_lengths",
                "critique_lengths", "max_response_tokens", "max_critique_tokens", "exchange_per_round_s",
                "plan_per_round_s")


def shared_cores(busy: int, cores: int) -> float:
    """How many times slower work runs while `busy` ranks work at once on `cores` cores, shared equally:
    the law bench/placements.py fits this machine's speeds under and the simulator replays them with."""
    return max(1.0, busy / cores)


class CalibrationError(ValueError):
    pass


def load(path: Path = CALIBRATION) -> dict:
    try:
        cal = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CalibrationError(f"{path}: {e}") from None
    validate(cal)
    return cal


def validate(node, where: str = "") -> None:
    """Every leaf is a figure {value, unit, source} with a number, a unit and a source; the only text
    allowed is a description or a model group's model names, which must name a model."""
    if isinstance(node, dict) and ({"value", "unit", "source"} & node.keys()):
        for key in ("unit", "source"):
            if not isinstance(node.get(key), str) or not node[key].strip():
                raise CalibrationError(f"calibration entry {where}: no {key}")
        if not isinstance(node.get("value"), (int, float)) or isinstance(node["value"], bool) \
                or not math.isfinite(node["value"]):
            raise CalibrationError(f"calibration entry {where}: no numeric value")
        return
    if not isinstance(node, dict):
        raise CalibrationError(f"calibration entry {where}: not a figure (value, unit, source)")
    for key, child in node.items():
        name = f"{where}.{key}" if where else key
        if key in TEXT_KEYS and isinstance(child, str):
            continue
        validate(child, name)
    for name, group in node.get("groups", {}).items():
        for role in ("policy", Role.JUDGE):
            if group.get(role) not in node.get("models", {}):
                raise CalibrationError(f"calibration entry groups.{name}.{role}: no model {group.get(role)!r} "
                                       f"in models")


def preset(cal: dict, name: str) -> dict:
    """The calibration a preset runs on: the top level (`h200`: H200s, the DAPO workload), or the section
    `name` over it (`paper`: its workload, models, groups and H20 figures in place of the top level's;
    the loop's and the planner's settings stay)."""
    if name == "h200":
        return cal
    if name not in cal:
        raise CalibrationError(f"calibration has no preset {name!r}")
    return {**cal, **cal[name]}


def value(cal: dict, path: str) -> float:
    node = cal
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            raise CalibrationError(f"calibration entry {path}: missing")
        node = node[key]
    return node["value"]


@dataclass
class Workload:
    prompts: int
    group_size: int
    prompt_tokens: int
    max_response: int
    max_critique: int
    lengths: object  # callable (rng, samples) -> (response lengths, critique lengths), int arrays
    # What the judge's template adds to prompt + response in its prompt (CPU: measured; the GPU workload's
    # prompt_tokens is an upper bound already, so nothing is added there).
    judge_template_tokens: int = 0

    def draw(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        return self.lengths(rng, self.prompts * self.group_size)


def lognormal(cap: int, p99_over_median: float):
    """Long-tailed lengths with the p99 at the budget and the median p99_over_median below it."""
    sigma = math.log(p99_over_median) / 2.326  # z of the 99th percentile
    median = cap / p99_over_median
    return lambda rng, n: np.clip(rng.lognormal(math.log(median), sigma, n), 1, cap).astype(np.int64)


def independent(responses, critiques):
    """Each response's length and each critique's drawn on their own: (rng, n) -> int array each."""
    return lambda rng, n: (responses(rng, n), critiques(rng, n))


def measured_groups(responses: list[int], critiques: list[int], group_size: int):
    """Whole groups as a run saw them: the lengths in group order (a prompt's G responses in a row, each
    critique beside its response), drawn a group at a time. A prompt's responses are alike in length (on
    the built-in task the operands' digits set it, and the critique quotes the response), so the work a
    rank is dealt comes in lumps; lengths drawn one by one would spread every rank's tail evenly."""
    responses, critiques = np.asarray(responses, dtype=np.int64), np.asarray(critiques, dtype=np.int64)
    if len(responses) != len(critiques) or len(responses) % group_size:
        raise CalibrationError(f"--measured has {len(responses)} response and {len(critiques)} critique lengths: "
                               f"both must be whole groups of {group_size} in the same order (bench/placements.py "
                               f"--json writes them so)")
    responses, critiques = responses.reshape(-1, group_size), critiques.reshape(-1, group_size)

    def draw(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        picks = rng.integers(len(responses), size=n // group_size)
        return responses[picks].ravel(), critiques[picks].ravel()
    return draw


def gpu_workload(cal: dict, prompts: int | None = None) -> Workload:
    w = lambda key: value(cal, f"workload.{key}")  # noqa: E731
    return Workload(int(prompts or w("prompts_per_step")), int(w("group_size")), int(w("prompt_tokens")),
                    int(w("max_response_tokens")), int(w("max_critique_tokens")),
                    independent(lognormal(int(w("max_response_tokens")), w("response_p99_over_median")),
                                lognormal(int(w("max_critique_tokens")), w("critique_p99_over_median"))))


class CostModel:
    """What the event engine asks of a cost model. Subclasses give engine_step_seconds(role, batch, context),
    shift_seconds(src, dst, train_slots, grads), publish_seconds(train_slots), train_per_s(train_slots),
    exchange_seconds(placement, slots) (what a round costs beyond its engines' steps and its shifts: every
    rank's report to rank 0, rank 0's choice of roles, its orders back), token_seconds(role) (the least
    slot-seconds an engine step costs per sequence it decodes and per token of context it holds, whatever its batch,
    within its room: what the work bound charges) and these figures:"""
    slot_gpus: int
    min_train_slots: int
    prefill_per_s: dict[str, float]  # per engine role, tokens per second per slot
    max_seqs: dict[str, int]  # per engine role, sequences in flight per slot
    prefill_chunk_tokens: int  # the most prompt tokens an engine step takes in (vLLM's chunked prefill)
    cores: int | None = None  # the cores all slots share; None: every slot has devices of its own

    def contention(self, busy: int) -> float:
        return shared_cores(busy, self.cores) if self.cores else 1.0

    def engine_sharing(self, role: str, busy: int) -> float:
        """How many times slower the role's engine steps run while `busy` slots work: `contention`."""
        return self.contention(busy)

    def planner_speeds(self, workload: Workload, slots: int) -> Speeds:
        """The speeds the simulated rank 0 starts from, fitted by the planner's own estimator."""
        engines = {}
        for role in (Role.ROLLOUT, Role.JUDGE):
            cap, fit = self.max_seqs[role], LinearFit(0.0, 0.0, hi=self.max_seqs[role], prior_weight=1e-6)
            ctx = workload.prompt_tokens + workload.max_response / 10 + (role == Role.JUDGE) * (
                workload.max_response / 10 + workload.judge_template_tokens)
            for b in (1, cap // 4 or 1, cap // 2 or 1, cap):
                fit.observe(b, self.engine_step_seconds(role, b, b * ctx))
            step_s, per_seq_s = fit.fit()
            engines[role] = EngineSpeed(step_s, per_seq_s, self.prefill_per_s[role], cap)
        return Speeds(engines[Role.ROLLOUT], engines[Role.JUDGE], self.train_per_s(slots))

    def planner_costs(self, slots: int) -> dict[tuple[str, str], float]:
        # Into the smallest train group it may form: the dearest such shift; train to train, a reshard.
        return {(a, b): self.shift_seconds(a, b, self.min_train_slots, False) for a in ROLES for b in ROLES
                if a != b or a == Role.TRAIN}


class GpuModel(CostModel):
    kv_layers = "layers"  # the model figure that counts the layers holding a KV cache

    def __init__(self, cal: dict, group: str, hardware: str = "h200"):
        if group not in cal["groups"]:
            raise CalibrationError(f"no model group {group!r}; calibration.json has {', '.join(cal['groups'])}")
        hw = lambda key: value(cal, f"{hardware}.{key}")  # noqa: E731
        g = cal["groups"][group]
        self.models = {Role.ROLLOUT: cal["models"][g["policy"]], Role.JUDGE: cal["models"][g[Role.JUDGE]]}
        m = lambda role, key: self.models[role][key]["value"]  # noqa: E731
        self.tp = {role: int(value(cal, f"groups.{group}.tp_{role}")) for role in (Role.ROLLOUT, Role.JUDGE)}
        try:
            self.slot_gpus, self.instances = book.slot_shape(self.tp)
        except ValueError as e:
            raise CalibrationError(f"groups.{group}: {e}") from None
        self.hbm, self.flops = hw("hbm_bytes_per_s"), hw("matmul_flops")
        self.wbytes, self.kvbytes = hw("weight_bytes_per_param"), hw("kv_bytes_per_value")
        self.m = m
        self.kv_per_token = {role: 2 * m(role, self.kv_layers) * m(role, "kv_heads") * m(role, "head_dim")
                             * self.kvbytes for role in self.tp}
        policy = m(Role.ROLLOUT, "params")
        self.train_rate = self.slot_gpus * hw("train_flops") / (hw("train_flops_per_token_per_param")
                                                                 * m(Role.ROLLOUT, "active_params"))
        self.min_train_slots = math.ceil(hw("train_state_bytes_per_param") * policy
                                         / (hw("memory_bytes") * self.slot_gpus))
        self.prefill_per_s = {role: self.slot_gpus * self.flops / (2 * m(role, "active_params")) for role in self.tp}
        self.max_seqs = {}
        work = gpu_workload(cal)
        for role in self.tp:
            fraction, most = self.engine_limits(cal, group, hardware, role)
            kv_tokens = (fraction * hw("memory_bytes") * self.tp[role]
                         - self.wbytes * m(role, "params")) / self.kv_per_token[role]
            ctx = work.prompt_tokens + work.max_response / 10 + (role == Role.JUDGE) * work.max_critique / 10
            self.max_seqs[role] = self.instances[role] * int(min(most, kv_tokens // ctx))
        self.prefill_chunk_tokens = int(hw("max_num_batched_tokens"))
        self.h2d, self.d2h, self.link = hw("h2d_bytes_per_s"), hw("d2h_bytes_per_s"), hw("node_link_bytes_per_s")
        self.wake, self.gpus_per_node = hw("engine_wake_s"), hw("gpus_per_node")
        self.state_bytes, self.stored_bytes = hw("train_state_bytes_per_param"), hw("stored_train_bytes_per_param")
        loop = lambda key: value(cal, f"loop.{key}")  # noqa: E731
        self.exchange_fixed, self.exchange_per_rank = loop("exchange_fixed_s"), loop("exchange_per_rank_s")
        self.plan_s, self.grad_bytes = loop("plan_s"), loop("stored_grad_bytes_per_param")

    def engine_limits(self, cal: dict, group: str, hardware: str, role: str) -> tuple[float, int]:
        """The share of a GPU's memory an engine of `role` takes (weights and KV cache), and the most
        sequences it runs at once: vLLM's defaults here."""
        return value(cal, f"{hardware}.kv_memory_fraction"), value(cal, f"{hardware}.max_num_seqs")

    def train_per_s(self, train_slots: int) -> float:
        return self.train_rate

    def weight_read_bytes(self, role: str, batch: int) -> float:
        """The bytes of weights one instance's engine step reads with `batch` sequences: an MoE layer
        reads only the experts its tokens route to, 1 - (1 - k/E)^b of them, uniform routing."""
        experts, k = self.m(role, "experts"), self.m(role, "experts_per_token")
        expert = self.m(role, "expert_params")
        touched = 1 - (1 - k / experts) ** batch
        return self.wbytes * (self.m(role, "params") - expert + expert * touched)

    def token_seconds(self, role: str) -> tuple[float, float]:
        """Memory-bound decode (the step is at least its reads): at the best batch per instance, the
        weights' read shared by its sequences; and every token of context read once a step."""
        n, room = self.instances[role], self.max_seqs[role] // self.instances[role]
        bandwidth = self.tp[role] * self.hbm
        per_seq = min(self.weight_read_bytes(role, b) / b for b in range(1, room + 1)) / bandwidth / n
        return per_seq, self.kv_per_token[role] / bandwidth / n

    def engine_step_seconds(self, role: str, batch: int, context: float) -> float:
        """One engine step of a slot's instances, `batch` sequences holding `context` tokens among them
        (weight_read_bytes: an MoE layer reads only the experts its tokens route to)."""
        n = self.instances[role]
        b, ctx = math.ceil(batch / n), context / n
        read = self.weight_read_bytes(role, b) + self.kv_per_token[role] * ctx
        memory = read / (self.tp[role] * self.hbm)
        compute = 2 * self.m(role, "active_params") * b / (self.tp[role] * self.flops)
        return max(memory, compute)

    def shift_seconds(self, src: str, dst: str, train_slots: int, grads: bool) -> float:
        """Offload src (an engine discards its weights: sleep level 2; the train role writes its state
        shards to storage), then onload dst from host storage over PCIe (an engine also wakes); train
        to train is a reshard into a new group. With `grads`, the gradients accumulated early go to
        storage and come back with the state."""
        params = self.m(Role.ROLLOUT, "params")
        gpus = max(train_slots, 1) * self.slot_gpus
        grad = self.grad_bytes if grads else 0.0
        off = (self.stored_bytes + grad) * params / gpus / self.d2h if src == Role.TRAIN else 0.0
        if dst == Role.TRAIN:
            return off + (self.state_bytes + grad) * params / gpus / self.h2d
        return off + self.wake + self.wbytes * self.m(dst, "params") / self.tp[dst] / self.h2d

    def exchange_seconds(self, placement: str, slots: int) -> float:
        """Every rank's report gathered by rank 0 and its orders scattered back (rank 0 handles each
        rank's in turn), and pivot's plan over that many ranks."""
        ranks = slots * self.slot_gpus
        return self.exchange_fixed + self.exchange_per_rank * ranks + (self.plan_s if placement == "pivot" else 0.0)

    def publish_seconds(self, train_slots: int) -> float:
        """The train ranks write their rows of the new weights to their node's storage, then every other
        node gets its replica over one link."""
        params = self.m(Role.ROLLOUT, "params")
        gpus = train_slots * self.slot_gpus
        nodes = math.ceil(gpus / self.gpus_per_node)
        return self.wbytes * params / gpus / self.d2h + (self.wbytes * params / self.link if nodes > 1 else 0.0)


class FittedGpuModel(GpuModel):
    """One model group of the paper's preset (`preset(cal, "paper")`) on H20s: GpuModel's memory, prefill,
    training and shifts, with each engine's decode step as the paper's release fitted it on H20 for that
    model at the group's tensor-parallel size (models.<m>.decode_*): per instance, seconds =
    A x KV tokens + max(B, b + C x running) + D. The release's planner reads the fit without b; the
    batches it was fitted on need it (8.19 ms at 64 sequences for Qwen2.5-7B, where max(B, C x 64) gives
    5.14). KV memory counts the layers with attention (a hybrid model's linear-attention layers keep a
    fixed state per sequence, which is left out)."""
    kv_layers = "attention_layers"

    def __init__(self, cal: dict, group: str):
        super().__init__(cal, group, hardware="h20")
        for role, tp in self.tp.items():
            fitted = int(self.m(role, "decode_tp"))
            if fitted != tp:
                raise CalibrationError(f"groups.{group}.tp_{role} is {tp} but its model's decode fit is at "
                                       f"tensor-parallel size {fitted}")
        self.fit = {role: tuple(self.m(role, f"decode_{key}") for key in ("kv_s", "floor_s", "intercept_s",
                                                                         "per_seq_s", "fixed_s"))
                    for role in self.tp}

    def engine_limits(self, cal: dict, group: str, hardware: str, role: str) -> tuple[float, int]:
        """As the group's launcher sets them; a judge instance also takes at most the router's
        concurrent requests."""
        most = value(cal, f"groups.{group}.max_seqs_{role}")
        if role == Role.JUDGE:
            most = min(most, value(cal, f"{hardware}.judge_router_requests"))
        return value(cal, f"groups.{group}.memory_fraction_{role}"), most

    def engine_step_seconds(self, role: str, batch: int, context: float) -> float:
        """One engine step of a slot's instances, `batch` sequences spread evenly over them: the busiest
        holds ceil(batch / instances) of them and their share of the `context` tokens."""
        a, floor, intercept, per_seq, fixed = self.fit[role]
        b = math.ceil(batch / self.instances[role])
        ctx = context * b / batch if batch else 0.0
        return a * ctx + max(floor, intercept + per_seq * b) + fixed

    def token_seconds(self, role: str) -> tuple[float, float]:
        """The fit at the best batch an instance holds, and its A per token of context."""
        a, floor, intercept, per_seq, fixed = self.fit[role]
        n, room = self.instances[role], self.max_seqs[role] // self.instances[role]
        per_seq_s = min((max(floor, intercept + per_seq * b) + fixed) / b for b in range(1, room + 1))
        return per_seq_s / n, a / n


SHARING_MIN_STEPS = 200  # engine steps a contention level needs before its measured slowdown counts


class CpuModel(CostModel):
    """This code on this machine, one rank per slot, from bench/placements.py's JSON (keys in CPU_MEASURED;
    its figures are uncontended: measured / max(1, ranks working / cores), the law applied here)."""

    def __init__(self, cal: dict, measured: dict):
        missing = [k for k in CPU_MEASURED if k not in measured]
        if missing:
            raise CalibrationError(f"--measured lacks {', '.join(missing)}: bench/placements.py --json writes them")
        rates = [measured[f"{r}_{k}"] for r in (Role.ROLLOUT, Role.JUDGE) for k in ("step_s", "per_seq_s", "prefill_per_s")]
        if not all(isinstance(x, (int, float)) and x >= 0 for x in rates):
            raise CalibrationError(f"--measured engine figures must be numbers >= 0, got {rates}")
        self.measured, self.slot_gpus, self.min_train_slots = measured, 1, 1
        self.cores = int(measured["cpus"])
        self.train_rates = {int(n): rate for n, rate in measured["train_tokens_per_s_by_ranks"].items()}
        self.prefill_per_s = {r: measured[f"{r}_prefill_per_s"] for r in (Role.ROLLOUT, Role.JUDGE)}
        self.max_seqs = {r: int(measured["max_seqs"]) for r in (Role.ROLLOUT, Role.JUDGE)}
        self.prefill_chunk_tokens = int(value(cal, "cpu.max_num_batched_tokens"))
        # Shift costs measured in the same runs win over bench/shift_latency.py's (shift_seconds).
        self.shift = {tuple(pair.split("->")): value(cal, f"cpu.shift_s.{pair}") for pair in cal["cpu"]["shift_s"]}
        self.measured_shift = {tuple(pair.split("->")): s for pair, s in measured.get("shift_s", {}).items()}

    def engine_step_seconds(self, role: str, batch: int, context: float) -> float:
        return self.measured[f"{role}_step_s"] + self.measured[f"{role}_per_seq_s"] * batch

    def engine_sharing(self, role: str, busy: int) -> float:
        """The law, times what the runs' decode-only steps at `busy` ranks working measured over the fit and
        the law (bench/placements.py's by_busy_ranks), where they measured SHARING_MIN_STEPS steps at that
        level at least; a JSON without those figures gets the law alone."""
        level = self.measured.get(f"{role}_by_busy_ranks", {}).get(str(busy), {})
        beyond = (level["decode_measured_s"] / level["decode_predicted_s"]
                  if level.get("decode_steps", 0) >= SHARING_MIN_STEPS and level["decode_predicted_s"] > 0 else 1.0)
        return self.contention(busy) * beyond

    def token_seconds(self, role: str) -> tuple[float, float]:
        return self.measured[f"{role}_step_s"] / self.max_seqs[role] + self.measured[f"{role}_per_seq_s"], 0.0

    def train_per_s(self, train_slots: int) -> float:
        """Measured for each train group size the runs trained all at once: on gloo, a larger FSDP group
        pays more communication per token, so the rate does not carry over from one size to another.
        Between two measured sizes (an early train group) the per-rank rate is interpolated linearly;
        beyond them, the nearest measured size's."""
        sizes = sorted(self.train_rates)
        if train_slots in self.train_rates:
            return self.train_rates[train_slots]
        if not sizes:
            raise CalibrationError("--measured has no training rate: bench/placements.py --json writes "
                                   "train_tokens_per_s_by_ranks")
        return float(np.interp(train_slots, sizes, [self.train_rates[n] for n in sizes]))

    def exchange_seconds(self, placement: str, slots: int) -> float:
        """Measured per round of the placement (at the bench's ranks): the exchange (a round's seconds
        beyond its busiest rank's work, rank 0's choice of roles and the shifts) and that choice (plan_s),
        which every rank waits for."""
        exchange, plan = self.measured["exchange_per_round_s"], self.measured["plan_per_round_s"]
        if placement not in exchange or placement not in plan:
            raise CalibrationError(f"no round measured for {placement} (measured: {', '.join(plan)}); "
                                   f"bench/placements.py skipped it")
        return exchange[placement] + plan[placement]

    def shift_seconds(self, src: str, dst: str, train_slots: int, grads: bool) -> float:
        """As measured (with whatever gradients the runs' shifts carried). A pair the bench's runs did not
        make costs as the dearest measured shift of its kind, the runs' own model and flags: into train
        (the rank builds the group's trainer and loads its rows), out of train (it saves the training
        state and loads the engine's weights), between the engines, or a rank that keeps its role (a
        disaggregated rollout rank reloading the new weights, as a shift out of train loads them; a
        train rank resharding into a new group, as a shift into train). Only where the runs made no
        shift of that kind, bench/shift_latency.py's figures in calibration.json, in the same way."""
        for costs in (self.measured_shift, self.shift):
            if (src, dst) in costs:
                return costs[(src, dst)]
            same = [cost for pair, cost in costs.items() if _shift_kind(*pair) == _shift_kind(src, dst)]
            if same:
                return max(same)
        raise CalibrationError(f"no shift {src}->{dst} nor one of its kind measured or in calibration.json")

    def publish_seconds(self, train_slots: int) -> float:
        return 0.0  # inside the measured training time (the train span covers train_step and publish)


def _shift_kind(src: str, dst: str) -> str:
    if dst == Role.TRAIN:
        return "into train"
    return "out of train" if src == Role.TRAIN or src == dst == Role.ROLLOUT else "between engines"


def cpu_workload(measured: dict) -> Workload:
    return Workload(int(measured["prompts_per_step"]), int(measured["group_size"]), round(measured["prompt_tokens"]),
                    int(measured["max_response_tokens"]), int(measured["max_critique_tokens"]),
                    measured_groups(measured["response_lengths"], measured["critique_lengths"],
                                    int(measured["group_size"])),
                    round(measured["judge_template_tokens"]))
