"""Many seeded random shift schedules over two ranks with real engines: every prompt yields exactly G
responses, each judged exactly once, every sequence token for token (and logprob for logprob) the one
generated without any move, and the policy update from them the same as without moves."""
import json
import random
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from algorithm import Algorithm, grpo_advantages
from roles.judge import Judge
from roles.rollout import RolloutEngine
from roles.trainer import PolicyTrainer
from runtime import init_distributed, shutdown_distributed
from shifting.context import RoleContext
from shifting.scheduler import Room, SamplingOptions, StepQueues, colocated_roles, forced_roles, generate
from storage import ParameterStorage, TrainState, checkpoint_storage
from tasks.dataset import encode_prompt
from timeline import Timeline

policy, judge_dir, template_path, trials, out = sys.argv[1:6]
template, trials = open(template_path).read(), int(trials)
d = init_distributed()
tok = AutoTokenizer.from_pretrained(policy)
rollout = RolloutEngine(policy, tok, seed=0, max_model_len=256, kv_cache_bytes=16 << 20)
judge = Judge(judge_dir, AutoTokenizer.from_pretrained(judge_dir), template, seed=0, max_model_len=256,
              kv_cache_bytes=16 << 20, max_tokens=96, on_parse_failure="fail", encode_prompt=encode_prompt)
hyper = dict(lr=1e-3, weight_decay=0.0, grad_clip=1.0, temperature=1.0, micro_batch=4)
state = TrainState(d, policy, keep_reference=False)
policy_storage = ParameterStorage(d, "policy", state.weight_shapes(torch.float32))
state.publish_weights(policy_storage, version=0)
timeline = Timeline(d, Path(out))
context = RoleContext(d, ["rollout"] * d.world_size, policy=policy_storage,
                      judge=checkpoint_storage(d, "judge", judge_dir, torch.float32), train_state=state,
                      rollout_engine=rollout.engine, judge_engine=judge.engine,
                      make_trainer=lambda group: PolicyTrainer(state, group, d.device, **hyper), observer=timeline)
prompts = [("347+85=", "432"), ("9999+1=", "10000"), ("5+5=", "10"), ("1234+4321=", "5555"), ("70+8=", "78")]
step_prompts = [{"prompt": p, "prompt_ids": tok(p).input_ids, "reference": r} for p, r in prompts]
sampling = SamplingOptions(group_size=3, seed=0, temperature=1.0, max_response_tokens=48, workload="task")


def run(next_roles, capacity, seed):
    queues = StepQueues(step_prompts, step=0, sampling=sampling, algo=Algorithm()) if d.rank == 0 else None
    samples, _, shifts, _ = generate(d, context, queues, next_roles, prompts=step_prompts, rollout=rollout, judge=judge,
                                  intake=Room(capacity), seed=seed, step=0, timeline=timeline)
    counts = [(queues.judge_runs, queues.migrated) if queues else None]
    torch.distributed.broadcast_object_list(counts, src=0)
    context.apply(["rollout"] * d.world_size)  # the next trial starts where a step starts
    return samples, shifts, *counts[0]


def update(samples):
    trainer = PolicyTrainer(TrainState(d, policy, keep_reference=False), d.tensors, d.device, **hyper)
    rewards = torch.tensor([s.reward for s in samples]).view(-1, sampling.group_size)
    for s, a in zip(samples, grpo_advantages(rewards).flatten().tolist()):
        s.advantage = a
    trainer.train_step([samples])
    return dict(trainer.full_weights())


still, _, still_runs, _ = run(colocated_roles, 64, 0)
results = {"reference_judge_runs": still_runs, "rewards": [s.reward for s in still], "trials": []}
moved_samples = None
for trial in range(trials):
    schedule = random.Random(trial)
    rate, capacity = schedule.choice([0.05, 0.2, 0.5]), schedule.choice([2, 5, 64])
    samples, shifts, runs, migrated = run(lambda roles, q, rng, rate=rate: forced_roles(roles, q, rng, rate),
                                          capacity, 1000 + trial)
    results["trials"].append({
        "rate": rate, "capacity": capacity, "keys": [list(s.key) for s in samples], "judge_runs": runs,
        "same_responses": [s.response_ids for s in samples] == [s.response_ids for s in still],
        "logprob_gap": max(abs(a - b) for s, t in zip(samples, still) for a, b in zip(s.logprobs, t.logprobs)),
        "same_critiques": [s.critique for s in samples] == [s.critique for s in still],
        "migrated": migrated, "shifts": len(shifts),
        "stages": sorted({k for shift in shifts for k in shift})})
    if moved_samples is None and migrated > 0:
        moved_samples = samples

still_weights, moved_weights = update(still), update(moved_samples)
results["weight_gap"] = max(((moved_weights[n] - w).norm() / w.norm().clamp_min(1e-12)).item()
                            for n, w in still_weights.items())
json.dump(results, open(f"{out}/rank{d.rank}.json", "w"))
del context, rollout, judge
shutdown_distributed(d)
