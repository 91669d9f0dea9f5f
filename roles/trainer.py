"""The policy update: GRPO on FSDP2 (`fully_shard`) over the train ranks.

GRPO, per group of G responses to one prompt: advantage_i = (r_i - mean(r)) / (std(r) + eps), the same
for every token of response i (a group of equal rewards gives zero advantages and no gradient). The loss
is PPO's clipped ratio objective against the rollout's sampling logprobs, summed over every response
token of the step and divided by that token count (token-level normalisation; `--loss-agg` offers
verl's per-sequence means instead), plus an optional k3 KL penalty to a frozen reference policy. As in
verl, the log-ratio is clamped before exp and a dual clip bounds the loss of tokens with a negative
advantage; an optimizer step whose gradient norm is not finite is skipped. The upper clip may be wider
than the lower (DAPO's clip-higher) and the learning rate may warm up linearly.

Rollout correction (`rollout_is`, for samples that older weights generated: --max-staleness K > 0): the
ratio is taken against pi_old, the logprobs of the weights the update starts from, recomputed here, and
each token's loss is weighted by the truncated importance ratio min(pi_old / pi_rollout, C) (verl's
decoupled objective: `verl/trainer/ppo/rollout_corr_helper.py` and `docs/algo/rollout_corr_math.md` in
volcengine/verl).
"""
import types

import torch
import torch.distributed as dist
from torch.distributed._composable import checkpoint as checkpoint_activations
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM

import faults
from algorithm import Algorithm
from roles import Role
from storage import TrainState, shard_rows


# The log-ratio's bound before exp, verl's (compute_policy_loss in verl/trainer/ppo/core_algos.py).
LOG_RATIO_BOUND = 20.0


def grpo_loss_sum(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  clip_eps: float, ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
                  clip_ratio_c: float = 0.0, clip_eps_high: float | None = None,
                  is_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over tokens of the per-token GRPO loss times `mask` (1 per response token, or the weights of
    `token_weights`); the caller divides by `loss_denominator`.

    logp, old_logp, mask, ref_logp, is_weights: [batch, T]; advantages: [batch] (broadcast over tokens).
    `clip_ratio_c` > 1 turns on the dual clip for negative advantages; 0 leaves it off. The ratio is
    clipped to [1 - clip_eps, 1 + clip_eps_high] (clip_eps_high None: clip_eps). `is_weights` (rollout
    correction) scale each token's policy loss, not its KL term, as verl's do."""
    adv = advantages[:, None]
    # Clamped as verl's compute_policy_loss does: an unbounded ratio overflows to inf, and where the
    # clipped term wins the unclipped one's gradient is then 0 * inf = NaN.
    ratio = torch.exp(torch.clamp(logp - old_logp, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    # Clip-higher (DAPO, Yu et al. 2025, arXiv:2503.14476, section 3.1): a wider upper bound lets a
    # low-probability token with a positive advantage grow further before its gradient stops.
    high = clip_eps if clip_eps_high is None else clip_eps_high
    per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + high) * adv)
    if clip_ratio_c:
        # Dual clip (Ye et al. 2020, arXiv:1912.09729; verl's clip_ratio_c): with a negative advantage the
        # loss is at most -clip_ratio_c * A, so a token whose ratio has run far past 1 stops pulling.
        per_token = torch.where(adv < 0, torch.minimum(per_token, -clip_ratio_c * adv), per_token)
    if is_weights is not None:
        per_token = per_token * is_weights
    if ref_logp is not None and kl_coef > 0:
        delta = ref_logp - logp
        per_token = per_token + kl_coef * (torch.exp(delta) - delta - 1)
    return (per_token * mask).sum()


def token_weights(mask: torch.Tensor, loss_agg: str) -> torch.Tensor:
    """The weight of each token's loss in the minibatch's sum ([batch, T]): the mask itself, or under
    seq-mean-token-mean the mask over its response's length. Each response's weights depend on that
    response alone, so sums over any split of a minibatch (micro-batches, early training) add up."""
    if loss_agg == "seq-mean-token-mean":
        return mask / mask.sum(dim=-1, keepdim=True).clamp(min=1)
    return mask


def loss_denominator(tokens: int, responses: int, loss_agg: str) -> int:
    """What the minibatch's weighted loss sum is divided by: its response tokens (token-mean), else its
    responses."""
    return max(tokens if loss_agg == "token-mean" else responses, 1)


def warmup_lr(lr: float, step: int, warmup_steps: int) -> float:
    """The learning rate of optimizer step `step` (1, 2, ...): linear warm-up from lr / warmup_steps at
    the first step to lr at step warmup_steps and after (0: lr throughout)."""
    return lr * step / warmup_steps if step < warmup_steps else lr


def rollout_is_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, level: str,
                       threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance weights of the rollout correction, and where the truncation bit (both
    [batch, T], zero off the mask): per token min(pi_old / pi_rollout, threshold); per sequence
    min(prod over its tokens of pi_old / pi_rollout, threshold) on each of its tokens. Log-ratios are
    clamped to +-LOG_RATIO_BOUND before exp, as the loss's are."""
    log_ratio = (old_logp - rollout_logp) * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(mask)
    ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    return torch.clamp(ratio, max=threshold) * mask, (ratio > threshold).float() * mask


# fp32 logits of at most this many bytes exist at once: a chunk of response positions at a time.
LOGIT_CHUNK_BYTES = 256 << 20


def logit_chunk_positions(vocab: int) -> int:
    """Response positions whose fp32 logits fit in LOGIT_CHUNK_BYTES."""
    return max(1, LOGIT_CHUNK_BYTES // (4 * vocab))


def response_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, mask: torch.Tensor,
                      temperature: float) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) at the positions t where `mask` [batch, T-1] is set (those that
    predict response tokens), under the sampling temperature; [batch, T-1], zero elsewhere.

    The decoder body runs to hidden states, the lm_head sees the masked positions only, and the
    log-softmax is taken a chunk of positions at a time, each chunk recomputed in backward: the fp32
    logits of one chunk exist at a time, never those of every position over the whole vocabulary.
    Under FSDP2 the lm_head and embedding live in the root unit: `PolicyTrainer` registers this function
    as a forward method of the root, so they are gathered around it."""
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    rows, cols = mask.nonzero(as_tuple=True)
    picked, targets = hidden[rows, cols], input_ids[rows, cols + 1]
    head = output_head(model)
    step = logit_chunk_positions(head.weight.shape[0])
    # At least one chunk, empty or not: the lm_head then has a gradient on every rank, as FSDP's
    # reduce-scatter of the root unit needs.
    flat = torch.cat([checkpoint(_chunk_logprobs, head, picked[i:i + step], targets[i:i + step], temperature,
                                 use_reentrant=False) for i in range(0, max(len(targets), 1), step)])
    return flat.new_zeros(mask.shape).index_put((rows, cols), flat)


def _chunk_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    # vLLM's sampler takes its logprobs as log_softmax(logits, dtype=float32) (compute_logprobs in
    # vllm/v1/sample/sampler.py): the same formula here, so the two differ only by the rounding of
    # the kernels before it (logsumexp would add its own).
    logits = head(hidden).float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def output_head(model) -> torch.nn.Linear:
    """The lm_head, applied here as a plain linear map (tied or not): models that scale or cap the logits
    after it would be scored wrong, so they are refused."""
    config = model.config.get_text_config()
    for knob in ("final_logit_softcapping", "logit_scale"):
        if getattr(config, knob, None) not in (None, 1.0):
            raise ValueError(f"{type(model).__name__} sets {knob}: roles/trainer.response_logprobs applies the "
                             f"lm_head alone; add the {knob} step there before training this model")
    return model.get_output_embeddings()


def pack(samples, device) -> dict[str, torch.Tensor]:
    """Right-padded prompt+response ids; masks and old logprobs aligned with response_logprobs' output."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    T = max(lengths)
    ids = torch.zeros(len(samples), T, dtype=torch.long)
    attention = torch.zeros(len(samples), T, dtype=torch.long)
    mask = torch.zeros(len(samples), T - 1)
    old = torch.zeros(len(samples), T - 1)
    pi_old = torch.zeros(len(samples), T - 1) if all(s.pi_old for s in samples) else None
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        ids[i, :p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        attention[i, :p + r] = 1
        mask[i, p - 1:p - 1 + r] = 1
        old[i, p - 1:p - 1 + r] = torch.tensor(s.logprobs)
        if pi_old is not None:
            pi_old[i, p - 1:p - 1 + r] = torch.tensor(s.pi_old)
    packed = dict(input_ids=ids, attention_mask=attention, mask=mask, old_logp=old)
    if pi_old is not None:
        packed["pi_old"] = pi_old
    return {k: v.to(device) for k, v in packed.items()}


def micro_batches(samples: list, max_samples: int, max_tokens: int = 0) -> list[list]:
    """`samples` in order, cut into micro-batches of at most `max_samples` and, when `max_tokens` is set,
    at most `max_tokens` prompt+response tokens once padded to the micro-batch's longest (what a forward
    pass holds); a sample longer than `max_tokens` is a micro-batch of its own."""
    batches, longest = [], 0
    for s in samples:
        length = len(s.prompt_ids) + len(s.response_ids)
        size = len(batches[-1]) + 1 if batches else 1
        if batches and size <= max_samples and (not max_tokens or size * max(longest, length) <= max_tokens):
            batches[-1].append(s)
            longest = max(longest, length)
        else:
            batches.append([s])
            longest = length
    return batches


# What early training adds up over a step (PolicyTrainer.accumulate's sums): nothing yet. `is_*`: the
# rollout correction's weights (sum, tokens truncated, largest).
NO_EARLY = {"loss_sum": 0.0, "clipped": 0.0, "gap_sum": 0.0, "gap_max": 0.0, "is_sum": 0.0, "is_truncated": 0.0,
            "is_max": 0.0, "tokens": 0, "samples": 0}
_MAXIMA = ("gap_max", "is_max")


def add_early(total: dict, more: dict) -> dict:
    """Two sets of early-training sums as one (the maxima are maxima)."""
    return {key: max(total[key], more[key]) if key in _MAXIMA else total[key] + more[key] for key in NO_EARLY}


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers FSDP2 shards one by one (a MoE layer with its experts): `model.model.layers` in
    every causal LM tested here (Qwen2, Llama, Qwen3, Qwen3-MoE)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no model.layers for FSDP2 to shard layer by layer; "
                         f"use a causal LM laid out like Qwen2 or Llama, or extend roles/trainer.decoder_layers")
    return layers


def inference_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class PolicyTrainer:
    """The policy's FSDP2 module and AdamW, sharded over `group` (the train ranks), loaded from and
    offloaded to the training state in storage (`storage.TrainState`): each rank holds the Shard(0) rows
    of every parameter and moment that its place in `group` gives it, so any group size can take over."""

    def __init__(self, state: TrainState, group: dist.ProcessGroup, device: torch.device, *, lr: float,
                 weight_decay: float, grad_clip: float, temperature: float, micro_batch: int,
                 algorithm: Algorithm = Algorithm(), micro_batch_tokens: int = 0,
                 activation_checkpointing: bool = False, adam_betas: tuple[float, float] = (0.9, 0.99),
                 lr_warmup_steps: int = 0):
        """`algorithm`: the loss's terms (clips, KL, aggregation, rollout correction); the rest is how the
        optimizer steps and how the work is cut into forward passes."""
        self.state, self.group, self.device, self.algorithm = state, group, device, algorithm
        self.temperature, self.lr, self.lr_warmup_steps = temperature, lr, lr_warmup_steps
        self.grad_clip, self.micro_batch, self.micro_batch_tokens = grad_clip, micro_batch, micro_batch_tokens
        self.activation_checkpointing = activation_checkpointing
        # Named after the group: meshes compare equal by ranks alone, so a group destroyed and made again
        # (shifting/context.py keeps two) would otherwise hit DTensor's cached shardings of the old mesh.
        mesh = DeviceMesh.from_group(group, device.type, mesh_dim_names=(f"train-{group.group_name}",))
        mp = MixedPrecisionPolicy(param_dtype=inference_dtype(device), reduce_dtype=torch.float32)
        self.model = self._sharded(mesh, mp, "master", activation_checkpointing)
        self.reference = (self._sharded(mesh, mp, "reference", False).requires_grad_(False)
                          if algorithm.keeps_reference else None)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=adam_betas,
                                           weight_decay=weight_decay)
        self._load_optimizer()
        self._load_grads()

    def _rows(self, p) -> int:
        """First row of dim 0 that this rank's shard of `p` holds."""
        first, stop = shard_rows(p.shape[0], dist.get_rank(self.group), dist.get_world_size(self.group))
        assert p.to_local().shape[0] == stop - first, "FSDP2 no longer shards like torch.chunk"
        return first

    def _sharded(self, mesh, mp, field: str, activation_checkpointing: bool):
        """An FSDP2 module built on the meta device, then filled with this rank's rows of `field`. With
        activation checkpointing each decoder layer keeps only its input for backward and runs again
        there, inside its FSDP unit (applied before fully_shard, as torchtitan's apply_ac does; the
        composable form keeps parameter names, which storage is keyed by)."""
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.state.config, dtype=torch.float32)
        for layer in decoder_layers(model):
            if activation_checkpointing:
                checkpoint_activations(layer)
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        model.response_logprobs = types.MethodType(response_logprobs, model)
        register_fsdp_forward_method(model, "response_logprobs")
        model.to_empty(device=self.device)
        self._fill(model, field)
        return model

    @torch.no_grad()
    def _fill(self, model, field: str) -> None:
        for name, p in model.named_parameters():
            local, first = p.to_local(), self._rows(p)
            local.copy_(self.state.view(f"{field}/{name}")[first:first + local.shape[0]])
        for name, b in model.named_buffers():
            b.copy_(self.state.view(f"buffer/{name}"))

    def _load_optimizer(self) -> None:
        # The stored moments and step, set as AdamW's state; at version 0 (zeros, step 0) this is
        # exactly the state a fresh AdamW creates on its first step.
        step = self.state.view("step")[0]
        for name, p in self.model.named_parameters():
            first = self._rows(p)
            moments = self.optimizer.state[p]
            moments["step"] = step.clone()
            for field in ("exp_avg", "exp_avg_sq"):
                local = moments.setdefault(field, torch.empty_like(p)).to_local()
                local.copy_(self.state.view(f"{field}/{name}")[first:first + local.shape[0]])

    def _load_grads(self) -> None:
        """The gradients a train group accumulated early in this step and left in storage, if any; else
        none. `accumulated` counts the response tokens they sum over."""
        self.accumulated = self.state.stored_grad_tokens()
        for name, p in self.model.named_parameters():
            if not self.accumulated:
                p.grad = None
                continue
            first, grad = self._rows(p), torch.zeros_like(p)
            local = grad.to_local()
            local.copy_(self.state.view(f"grad/{name}")[first:first + local.shape[0]])
            p.grad = grad

    def reload(self) -> None:
        """Loads the stored state into this trainer's own tensors, for the same group: the onload of a
        trainer kept allocated (on CPU, where freeing would only trade a copy for page faults)."""
        self._fill(self.model, "master")
        self._load_optimizer()
        self._load_grads()

    def state_rows(self):
        """(name, rows, first row) of this rank's master weights, moments and step, for
        `TrainState.state.publish_shards`."""
        for name, p in self.model.named_parameters():
            first, moments = self._rows(p), self.optimizer.state[p]
            yield f"master/{name}", p.to_local().detach(), first
            yield f"exp_avg/{name}", moments["exp_avg"].to_local(), first
            yield f"exp_avg_sq/{name}", moments["exp_avg_sq"].to_local(), first
        if dist.get_rank(self.group) == 0:
            yield "step", torch.tensor([float(self.optimizer_steps)]), 0

    def grad_rows(self):
        """(name, rows, first row) of this rank's accumulated gradients (zeros when it holds none) and
        the tokens they sum over, for `TrainState.partial.publish_shards`."""
        for name, p in self.model.named_parameters():
            yield f"grad/{name}", torch.zeros_like(p.to_local()) if p.grad is None else p.grad.to_local(), self._rows(p)
        if dist.get_rank(self.group) == 0:
            yield "grad_tokens", torch.tensor([float(self.accumulated)]), 0

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken since version 0 of the training state."""
        return int(self.optimizer.state[next(self.model.parameters())]["step"].item())

    def weight_rows(self):
        """(name, rows in inference dtype, first row) of this rank's weights, for a policy publish."""
        dtype = inference_dtype(self.device)
        for name, p in self.model.named_parameters():
            yield name, p.to_local().detach().to(dtype), self._rows(p)

    def weight_shapes(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """Names, full shapes and inference dtype of the weights an engine loads."""
        return self.state.weight_shapes(inference_dtype(self.device))

    def full_weights(self):
        """Yields (hf_name, full tensor on CPU); collective over the train group."""
        dtype = inference_dtype(self.device)
        for name, p in self.model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            yield name, full.detach().to("cpu", dtype)

    def close(self) -> None:
        """Frees the module, the reference and the optimizer (offload their state to storage first)."""
        self.model = self.reference = self.optimizer = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def accumulate(self, samples: list) -> dict:
        """Early training: forward and backward over `samples` (judged groups of the step's only
        minibatch), adding their gradients to this group's; the optimizer steps later, in `train_step`,
        once every group is in. Every train rank is handed the same samples and works on its strided
        share. The step's token and response counts are not known yet, so these gradients are weighted
        sums (`token_weights`: each response's weights are its own), divided by `loss_denominator` when
        `train_step` finishes the minibatch. Returns this group's sums over them: loss, clipped tokens,
        response tokens, responses and the logprob gap (see `train_step`)."""
        if not self.accumulated:
            self.optimizer.zero_grad(set_to_none=True)
        self.model.train()
        sums = self._backward(samples, denominator=1)
        tokens = sum(len(s.response_ids) for s in samples)
        self.accumulated += tokens
        return {**sums, "tokens": tokens, "samples": len(samples)}

    def agree(self, mine: bool) -> bool:
        """Whether any rank of the train group says yes: one small all-reduce, on the group's device."""
        flag = torch.tensor([float(mine)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def _micro_chunks(self, samples: list) -> list[list | None]:
        """This rank's micro-batches of its strided share of `samples`, then None up to the busiest
        rank's count: every rank runs the same number of micro-steps, as FSDP's collectives must pair
        up. Each rank holds the whole of `samples`, so each knows every rank's share without asking."""
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        shares = [micro_batches(samples[r::world], self.micro_batch, self.micro_batch_tokens) for r in range(world)]
        return shares[rank] + [None] * (max(len(share) for share in shares) - len(shares[rank]))

    def _backward(self, samples: list, denominator: int) -> dict:
        """Forward and backward of this rank's strided share of `samples`, the loss sum over
        `denominator` (`loss_denominator`); returns the group's sums (loss, clipped tokens, logprob gap,
        rollout-correction weights and truncated tokens) and maxima (logprob gap, weight)."""
        world = dist.get_world_size(self.group)
        sums = torch.zeros(5, device=self.device)  # loss, clipped tokens, logprob gap, IS weights, truncated
        largest = torch.zeros(2, device=self.device)  # logprob gap, IS weight
        for chunk in self._micro_chunks(samples):
            loss, counts, maxima = self._micro_step(chunk or samples[:1], real=bool(chunk))
            # FSDP averages gradients over the group; this scale makes them the minibatch's mean.
            (loss * world / denominator).backward()
            # Kept on the device: no host round trip per micro-step.
            sums += torch.cat([loss.detach().reshape(1), counts])
            largest = torch.maximum(largest, maxima)
        dist.all_reduce(sums, group=self.group)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.group)
        loss_sum, clipped, gap_sum, is_sum, is_truncated = sums.tolist()
        gap_max, is_max = largest.tolist()
        return {"loss_sum": loss_sum, "clipped": clipped, "gap_sum": gap_sum, "gap_max": gap_max,
                "is_sum": is_sum, "is_truncated": is_truncated, "is_max": is_max}

    def train_step(self, minibatches: list[list], early: dict | None = None, skipped_in_row: int = 0) -> dict:
        """One optimizer step per minibatch. Every train rank is handed the same global minibatches
        (samples carrying `.advantage`) and works on its strided share of each. With early training,
        the first (and only) minibatch holds just the samples not trained yet, `early` the sums of
        those that were (`accumulate`), whose gradients this group holds or loaded from storage.

        A minibatch whose gradient norm is not finite takes no step: its gradients are dropped, the
        weights and AdamW's moments and step count stay as they were. `skipped_in_row` (optimizer steps
        skipped in a row before this update) continues into the returned `skipped_in_row`. The logprob
        gap (to the sampling logprobs) is the first minibatch's: later ones are scored by updated weights."""
        stats = {"loss": 0.0, "clip_frac": 0.0, "grad_norm": 0.0, "tokens": 0, "skipped_updates": 0}
        self.model.train()
        if self.algorithm.rollout_is != "off" and len(minibatches) > 1:
            self._keep_pi_old(minibatches)
        for index, mb in enumerate(minibatches):
            carried = early if index == 0 and early else NO_EARLY
            assert carried["tokens"] == (self.accumulated if index == 0 else 0), "early gradients out of step"
            total_tokens = sum(len(s.response_ids) for s in mb) + carried["tokens"]
            denominator = loss_denominator(total_tokens, len(mb) + carried["samples"], self.algorithm.loss_agg)
            if carried["tokens"]:
                for p in self.model.parameters():  # the early weighted sums, as a share of the mean
                    if p.grad is not None:
                        p.grad.mul_(1.0 / denominator)
            else:
                self.optimizer.zero_grad(set_to_none=True)
            sums = self._backward(mb, denominator) if mb else NO_EARLY
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            if isinstance(grad_norm, DTensor):
                grad_norm = grad_norm.full_tensor()
            faults.point(Role.TRAIN, dist.get_rank())
            if torch.isfinite(grad_norm):
                if self.lr_warmup_steps:
                    for group in self.optimizer.param_groups:
                        group["lr"] = warmup_lr(self.lr, self.optimizer_steps + 1, self.lr_warmup_steps)
                self.optimizer.step()
                skipped_in_row = 0
            else:
                # Stepping would write the NaN or inf into every weight and moment it reaches.
                self.optimizer.zero_grad(set_to_none=True)
                stats["skipped_updates"] += 1
                skipped_in_row += 1
            self.accumulated = 0
            if index == 0:  # mean and max over the response tokens of |trainer logprob - sampling logprob|
                stats["logprob_gap_mean"] = (sums["gap_sum"] + carried["gap_sum"]) / max(total_tokens, 1)
                stats["logprob_gap_max"] = max(sums["gap_max"], carried["gap_max"])
                if self.algorithm.rollout_is != "off":  # the correction's weights over the same tokens
                    stats["rollout_is_mean"] = (sums["is_sum"] + carried["is_sum"]) / max(total_tokens, 1)
                    stats["rollout_is_max"] = max(sums["is_max"], carried["is_max"])
                    stats["rollout_is_truncated"] = ((sums["is_truncated"] + carried["is_truncated"])
                                                     / max(total_tokens, 1))
            stats["loss"] += (sums["loss_sum"] + carried["loss_sum"]) / denominator / len(minibatches)
            stats["clip_frac"] += (sums["clipped"] + carried["clipped"]) / max(total_tokens, 1) / len(minibatches)
            stats["grad_norm"] += grad_norm.item() / len(minibatches)
            stats["tokens"] += total_tokens
        stats["skipped_in_row"] = skipped_in_row
        return stats

    def _keep_pi_old(self, minibatches: list[list]) -> None:
        """Rollout correction over several minibatches: pi_old, the logprobs of the weights the update
        starts from, of every sample in this rank's shares, before the first optimizer step moves them
        (one minibatch needs no such pass: its forward is at those weights)."""
        with torch.no_grad():
            for mb in minibatches:
                for chunk in self._micro_chunks(mb):
                    logp = self.logprobs(self.model, pack(chunk or mb[:1], self.device))
                    for row, s in enumerate(chunk or []):
                        p = len(s.prompt_ids)
                        s.pi_old = logp[row, p - 1:p - 1 + len(s.response_ids)].tolist()

    def logprobs(self, model, batch: dict) -> torch.Tensor:
        """Logprobs of `batch`'s response tokens under `model` (the policy or the reference)."""
        return model.response_logprobs(batch["input_ids"], batch["attention_mask"], batch["mask"],
                                       self.temperature)

    def _micro_step(self, chunk, real: bool):
        """Over the response tokens of `chunk`: the loss sum; the clipped-token count, the logprob gap's
        sum (trainer against sampling logprobs), the rollout correction's weights' sum and truncated
        tokens; the gap's and the weights' maxima. A stand-in chunk (real=False) counts nothing."""
        batch = pack(chunk, self.device)
        mask = batch["mask"] if real else torch.zeros_like(batch["mask"])
        logp = self.logprobs(self.model, batch)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = self.logprobs(self.reference, batch)
        advantages = torch.tensor([s.advantage for s in chunk], device=self.device, dtype=logp.dtype)
        old, weights = batch["old_logp"], None
        zero = torch.zeros((), device=self.device)
        is_sum = is_truncated = is_max = zero
        if self.algorithm.rollout_is != "off":
            old = batch["pi_old"] if "pi_old" in batch else logp.detach()
            weights, truncated = rollout_is_weights(old, batch["old_logp"], mask, self.algorithm.rollout_is,
                                                    self.algorithm.rollout_is_threshold)
            is_sum, is_truncated, is_max = weights.sum(), truncated.sum(), weights.max()
        algo = self.algorithm
        loss = grpo_loss_sum(logp, old, advantages, token_weights(mask, algo.loss_agg), algo.clip_eps, ref,
                             algo.kl_coef, algo.clip_ratio_c, algo.clip_eps_high, weights)
        with torch.no_grad():
            ratio = torch.exp(logp - old)
            if algo.clip_eps_high is None:
                clipped = (((ratio - 1).abs() > algo.clip_eps).float() * mask).sum()
            else:
                clipped = (((ratio > 1 + algo.clip_eps_high) | (ratio < 1 - algo.clip_eps)).float() * mask).sum()
            gap = (logp - batch["old_logp"]).abs() * mask
        return (loss, torch.stack([clipped, gap.sum(), is_sum, is_truncated]).detach(),
                torch.stack([gap.max(), is_max]).detach())
