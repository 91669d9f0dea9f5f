"""Early training: the update of a step whose first groups were trained on a smaller train group while
the step still ran (gradients accumulated, then carried through storage into the step's final train
group) against the same update taken all at once. Also the case where the early group is the final
one (the gradients stay where they are)."""
import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from algorithm import LOSS_AGGS, Algorithm, group_advantages
from batches import well_conditioned
from roles.rollout import Sample
from roles.trainer import NO_EARLY, PolicyTrainer, add_early
from runtime import init_distributed, shutdown_distributed
from storage import TrainState

policy_dir, out = sys.argv[1:3]
d = init_distributed()
tok = AutoTokenizer.from_pretrained(policy_dir)
hyper = dict(lr=1e-3, weight_decay=0.01, grad_clip=1.0, temperature=1.0,
             micro_batch=3)
prompts = [tok(p).input_ids for p in ("12+34=", "999+1=", "5+5=", "70+8=", "4071+389=")]
G = 4


def step_samples() -> list[Sample]:
    """A step's samples with rewards, advantages and sampling logprobs off the trainer's (a ratio != 1)."""
    gen = torch.Generator().manual_seed(7)
    samples = []
    for i, ids in enumerate(prompts):
        for g in range(G):
            response = torch.randint(2, 38, (2 + (3 * i + g) % 9,), generator=gen).tolist()
            logprobs = (-3.0 - torch.rand(len(response), generator=gen)).tolist()
            samples.append(Sample(i, g, ids, response, logprobs, "stop", reward=float((i + g) % 3 == 0)))
    group_advantages(Algorithm(), [samples[i:i + G] for i in range(0, len(samples), G)])
    return samples


def weights(trainer: PolicyTrainer) -> dict:
    return dict(trainer.full_weights())


def gap(a: dict, b: dict) -> float:
    """Relative distance over all the weights together (a parameter with an exactly zero true gradient,
    such as k_proj's bias, moves by float noise alone)."""
    return (sum((a[n] - w).norm() ** 2 for n, w in b.items()) / sum(w.norm() ** 2 for w in b.values())).sqrt().item()


samples = step_samples()


def trainer_for(state: TrainState, group, hyper: dict) -> PolicyTrainer:
    """A trainer whose AdamW is linear in the gradients: the early gradients are sums in another order."""
    trainer = PolicyTrainer(state, group, d.device, **hyper)
    well_conditioned(trainer)
    return trainer


def compare(hyper: dict) -> dict:
    early_groups = [[0, 1], [3]]  # two rounds of early training
    trained = [p for groups in early_groups for p in groups]
    rest = [s for s in samples if s.prompt_index not in trained]

    whole = trainer_for(TrainState(d, policy_dir, keep_reference=False), d.tensors, hyper)
    whole.train_step([samples])
    reference = weights(whole)

    # Rank 1 trains the early groups alone; the state (with its gradients) goes through storage to both.
    state = TrainState(d, policy_dir, keep_reference=False, keep_grads=True)
    alone = dist.new_group([1])
    early = NO_EARLY
    trainer = None
    if d.rank == 1:
        trainer = PolicyTrainer(state, alone, d.device, **hyper)
        for groups in early_groups:
            early = add_early(early, trainer.accumulate([s for s in samples if s.prompt_index in groups]))
    state.save(trainer)
    shared = [None, None]
    dist.all_gather_object(shared, early)
    early = shared[1]
    stored_tokens = state.stored_grad_tokens()
    final = trainer_for(state, d.tensors, hyper)
    stats = final.train_step([rest], early)
    carried = gap(weights(final), reference)

    # The early group is the final one: no regroup, the gradients never leave the trainer.
    kept = trainer_for(TrainState(d, policy_dir, keep_reference=False, keep_grads=True), d.tensors, hyper)
    early = NO_EARLY
    for groups in early_groups:
        early = add_early(early, kept.accumulate([s for s in samples if s.prompt_index in groups]))
    kept_stats = kept.train_step([rest], early)
    in_place = gap(weights(kept), reference)

    whole_again = trainer_for(TrainState(d, policy_dir, keep_reference=False), d.tensors, hyper)
    whole_stats = whole_again.train_step([samples])
    return {"positions": sum(len(s.prompt_ids) + len(s.response_ids) for s in samples), "carried_gap": carried, "in_place_gap": in_place, "stored_tokens": stored_tokens,
            "early_tokens": early["tokens"], "early_samples": early["samples"], "moved": gap(reference, weights(
                PolicyTrainer(TrainState(d, policy_dir, keep_reference=False), d.tensors, d.device, **hyper))),
            "stats": [stats, kept_stats, whole_stats]}


results = {agg: compare({**hyper, "algorithm": Algorithm(loss_agg=agg)}) for agg in LOSS_AGGS}
json.dump(results, open(f"{out}/rank{d.rank}.json", "w"))
shutdown_distributed(d)
