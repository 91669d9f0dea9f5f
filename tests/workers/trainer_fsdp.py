"""The FSDP2 trainer on two ranks, against plain single-process computations of the same thing.

    trainer_fsdp.py OUT logprobs MODEL_DIR...   each model's response logprobs under FSDP2 vs the full
                                                vocabulary computation on the unsharded model
Writes OUT/rank{R}.json."""
import json
import random
import sys

import torch
from transformers import AutoModelForCausalLM

from roles.rollout import Sample
from roles.trainer import PolicyTrainer, pack
from runtime import init_distributed, shutdown_distributed
from storage import TrainState

HYPER = dict(lr=1e-3, weight_decay=0.01, grad_clip=1.0, clip_eps=0.2, kl_coef=0.0)


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


if __name__ == "__main__":
    out, what, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    d = init_distributed()
    result = {"logprobs": logprob_gaps}[what](d, rest)
    with open(f"{out}/rank{d.rank}.json", "w") as f:
        json.dump(result, f)
    shutdown_distributed(d)
