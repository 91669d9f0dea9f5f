"""The FSDP2 trainer on two ranks, against plain single-process computations of the same thing.

    trainer_fsdp.py OUT logprobs MODEL_DIR...   each model's response logprobs under FSDP2 vs the full
                                                vocabulary computation on the unsharded model
    trainer_fsdp.py OUT micro-batching POLICY   one GRPO step (and one of two minibatches) under several
                                                micro-batchings, token budgets and activation checkpointing
    trainer_fsdp.py OUT safeguards POLICY       AdamW's betas, and steps skipped for a non-finite gradient
Writes OUT/rank{R}.json."""
import dataclasses
import json
import math
import random
import sys

import torch
from transformers import AutoModelForCausalLM

from batches import well_conditioned
from roles.rollout import Sample
from roles.trainer import PolicyTrainer, decoder_layers, micro_batches, pack
from runtime import init_distributed, shutdown_distributed
from storage import TrainState

HYPER = dict(lr=1e-3, weight_decay=0.01, grad_clip=1.0)


def synthetic_samples(vocab: int, count: int, seed: int) -> list[Sample]:
    """Samples of varied prompt and response lengths, random tokens; logprobs and advantages are set
    by the caller."""
    rng = random.Random(seed)
    samples = []
    for i in range(count):
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(3, 12))]
        response = [rng.randrange(2, vocab) for _ in range(rng.randint(1, 20))]
        samples.append(Sample(i, 0, prompt, response, [0.0] * len(response), "stop"))
    return samples


def full_vocabulary_logprobs(model, batch, temperature: float) -> torch.Tensor:
    """The reference: fp32 log-softmax over the whole vocabulary at every position; [batch, T-1]."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1) * batch["mask"]


def logprob_gaps(d, model_dirs: list[str]) -> dict:
    gaps = {}
    for model_dir in model_dirs:
        state = TrainState(d, model_dir, keep_reference=False)
        trainer = PolicyTrainer(state, d.tensors, d.device, temperature=0.7, micro_batch=8, **HYPER)
        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        batch = pack(synthetic_samples(plain.config.vocab_size, 6, seed=d.rank), d.device)
        with torch.no_grad():
            sharded = trainer.logprobs(trainer.model, batch)
            expected = full_vocabulary_logprobs(plain, batch, 0.7)
        gaps[model_dir] = (sharded - expected).abs().max().item()
        trainer.close()
        state.close()
    return gaps


MICRO_BATCHINGS = {
    "micro-batch 32": dict(micro_batch=32),
    "micro-batch 3": dict(micro_batch=3),
    "budget 120 tokens": dict(micro_batch=32, micro_batch_tokens=120),
    "budget 120 tokens, checkpointed": dict(micro_batch=32, micro_batch_tokens=120, activation_checkpointing=True),
    "budget 30 tokens, checkpointed": dict(micro_batch=32, micro_batch_tokens=30, activation_checkpointing=True),
    "micro-batch 3, checkpointed": dict(micro_batch=3, activation_checkpointing=True),
}


def scored_samples(policy: str) -> list[Sample]:
    """22 samples, the same on every rank, whose sampling logprobs are the policy's own shifted by up to
    0.3 nats (so some ratios fall outside the clip range), with advantages of both signs."""
    plain = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    samples = synthetic_samples(plain.config.vocab_size, 22, seed=7)
    batch = pack(samples, torch.device("cpu"))
    with torch.no_grad():
        logp = full_vocabulary_logprobs(plain, batch, 1.0)
    g = torch.Generator().manual_seed(8)
    for i, s in enumerate(samples):
        p = len(s.prompt_ids)
        noise = (torch.rand(len(s.response_ids), generator=g) - 0.5) * 0.6
        s.logprobs = (logp[i, p - 1:p - 1 + len(s.response_ids)] + noise).tolist()
        s.advantage = torch.randn(1, generator=g).item()
    return samples


def micro_batching(d, args: list[str]) -> dict:
    """Per micro-batching: the step's loss and gradient norm, each minibatch's gradients (this rank's
    shard, clipped, as the optimizer sees them) and the weights after the step, as distances relative
    to the first micro-batching's; how far the step moved the weights, and how often layer 0 ran
    forward. AdamW is made linear in the gradients (`well_conditioned`)."""
    policy, = args
    samples = scored_samples(policy)
    state = TrainState(d, policy, keep_reference=False)
    initial = {n: p.detach().clone() for n, p in AutoModelForCausalLM.from_pretrained(policy).named_parameters()}
    first, first_grads, result = {}, {}, {}
    for minibatches in (1, 2):
        for name, config in MICRO_BATCHINGS.items():
            trainer = PolicyTrainer(state, d.tensors, d.device, temperature=1.0, **HYPER, **config)
            well_conditioned(trainer)
            grads = []
            trainer.optimizer.register_step_pre_hook(lambda *_: grads.append(
                {n: p.grad.to_local().clone() for n, p in trainer.model.named_parameters()}))
            calls = [0]
            # a pre-hook: a recomputation stops once it has what backward needs, before forward hooks
            decoder_layers(trainer.model)[0].register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
            half = len(samples) // minibatches
            split = [samples[i:i + half] for i in range(0, len(samples), half)]
            stats = trainer.train_step(split)
            weights = dict(trainer.full_weights())
            first.setdefault(minibatches, weights)
            first_grads.setdefault(minibatches, grads)
            reference = first[minibatches]
            result[f"{minibatches} minibatches, {name}"] = {
                **stats, "layer0_forwards": calls[0],
                "grad_gaps": [relative(g, ref) for g, ref in zip(grads, first_grads[minibatches])],
                "positions": [sum(len(s.prompt_ids) + len(s.response_ids) for s in mb) for mb in split],
                "micro_steps": [[len(micro_batches(mb[r::d.world_size], config["micro_batch"],
                                                   config.get("micro_batch_tokens", 0))) for r in range(d.world_size)]
                                for mb in split],
                "weight_gap": relative(weights, reference), "moved": relative(weights, initial)}
            trainer.close()
    state.close()
    return result


def safeguards(d, args: list[str]) -> dict:
    """A good step with betas (0.5, 0.6), then two steps whose gradient is NaN (a sample with a NaN
    advantage), then a good one: what the moments were after the first, and what each skipped
    step left of the weights, moments and step count."""
    policy, = args
    samples = scored_samples(policy)
    poisoned = [*samples[:-1], dataclasses.replace(samples[-1], advantage=float("nan"))]
    state = TrainState(d, policy, keep_reference=False)
    trainer = PolicyTrainer(state, d.tensors, d.device, temperature=1.0, micro_batch=4, adam_betas=(0.5, 0.6),
                            **HYPER)
    first = trainer.train_step([samples])
    params = list(trainer.model.parameters())
    moments = [trainer.optimizer.state[p] for p in params]
    # AdamW's first step from zero moments: exp_avg = (1 - beta1) g, exp_avg_sq = (1 - beta2) g^2
    betas = max(max((m["exp_avg"].to_local() - 0.5 * p.grad.to_local()).abs().max().item(),
                    (m["exp_avg_sq"].to_local() - 0.4 * p.grad.to_local() ** 2).abs().max().item())
                for p, m in zip(params, moments))

    def snapshot():
        return [t.to_local().clone() for p, m in zip(params, moments) for t in (p, m["exp_avg"], m["exp_avg_sq"])]

    before, steps, runs = snapshot(), trainer.optimizer_steps, []
    in_row = first["skipped_in_row"]
    for batch in (poisoned, poisoned, samples):
        stats = trainer.train_step([batch], skipped_in_row=in_row)
        in_row = stats["skipped_in_row"]
        after = snapshot()
        runs.append({"skipped_updates": stats["skipped_updates"], "skipped_in_row": in_row,
                     "grad_norm_finite": math.isfinite(stats["grad_norm"]), "steps": trainer.optimizer_steps,
                     "unchanged": all(torch.equal(a, b) for a, b in zip(before, after)),
                     "grads_dropped": all(p.grad is None for p in params)})
    trainer.close()
    state.close()
    return {"first": {k: first[k] for k in ("skipped_updates", "skipped_in_row")}, "betas_gap": betas,
            "steps_before": steps, "runs": runs, "warmup": warmup_moves(d, policy, samples)}


def warmup_moves(d, policy: str, samples) -> list[float]:
    """How far the first two optimizer steps under --lr-warmup-steps 4 move the weights, as a fraction
    of how far the same steps move them at the full rate: AdamW's step is proportional to the learning
    rate, decay included, so the warm-up's first step moves a quarter as far. The second step starts
    from other weights, so only the first is compared."""
    moves = []
    for warmup in (4, 0):
        state = TrainState(d, policy, keep_reference=False)
        trainer = PolicyTrainer(state, d.tensors, d.device, temperature=1.0, micro_batch=4, lr_warmup_steps=warmup,
                                **HYPER)
        before = [p.to_local().clone() for p in trainer.model.parameters()]
        trainer.train_step([samples])
        moves.append(torch.cat([(p.to_local() - b).flatten() for p, b in zip(trainer.model.parameters(), before)]))
        trainer.close()
        state.close()
    warm, full = moves
    return [(warm - full / 4).abs().max().item(), full.abs().max().item()]


def relative(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over every tensor of the two state dicts."""
    return (sum((a[n] - b[n]).norm() ** 2 for n in b) / sum(b[n].norm() ** 2 for n in b)).sqrt().item()


if __name__ == "__main__":
    out, what, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    d = init_distributed()
    result = {"logprobs": logprob_gaps, "micro-batching": micro_batching, "safeguards": safeguards}[what](d, rest)
    with open(f"{out}/rank{d.rank}.json", "w") as f:
        json.dump(result, f)
    shutdown_distributed(d)
