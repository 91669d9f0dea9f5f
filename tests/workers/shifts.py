"""Every ordered pair of role shifts on two ranks, each followed by the new role's work; then the train
group resized 2 -> 1 -> 2. A second trainer, never shifted or resized, takes the same steps on the same
data: the reference the shifted one is compared with."""
import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from roles.engine import Engine, Request
from roles.trainer import PolicyTrainer
from batches import scored_batch
from runtime import init_distributed, shutdown_distributed
from shifting.context import RoleContext
from storage import ParameterStorage, TrainState, checkpoint_storage

policy_dir, judge_dir, out = sys.argv[1:4]
d = init_distributed()
tok = AutoTokenizer.from_pretrained(policy_dir)
hyper = dict(lr=1e-3, weight_decay=0.01, grad_clip=1.0, temperature=1.0,
             micro_batch=2)
state = TrainState(d, policy_dir, keep_reference=False)
policy = ParameterStorage(d, "policy", state.weight_shapes(torch.float32))
state.publish_weights(policy, version=0)
judge = checkpoint_storage(d, "judge", judge_dir, torch.float32)
engines = {role: Engine(path, seed=0, max_model_len=128, kv_cache_bytes=16 << 20)
           for role, path in (("rollout", policy_dir), ("judge", judge_dir))}
ctx = RoleContext(d, ["rollout", "rollout"], policy=policy, judge=judge, train_state=state,
                  rollout_engine=engines["rollout"], judge_engine=engines["judge"],
                  make_trainer=lambda group: PolicyTrainer(state, group, d.device, **hyper))
reference = PolicyTrainer(TrainState(d, policy_dir, keep_reference=False), d.tensors, d.device, **hyper)
prompts = [tok(p).input_ids for p in ("12+34=", "999+1=", "5+5=", "70+8=")]


def greedy_agrees(model, prompt_ids: list[int], tokens: list[int], tol: float = 1e-3) -> bool:
    """Each token is the argmax of `model` given the ones before it (to within float noise: a random
    model's near-equal logits may order differently under vLLM's kernels than under torch's)."""
    logits = model(torch.tensor([prompt_ids + tokens])).logits[0, len(prompt_ids) - 1:-1]
    chosen = logits.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
    return bool((chosen >= logits.max(-1).values - tol).all())


def engine_serves(role: str, storage: ParameterStorage, model_dir: str) -> bool:
    """The engine's greedy output is that of the weights the storage holds now."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(dict(storage.named_tensors()), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    done = engines[role].run([Request("rollout", (i, 0), ids, 8, 0.0) for i, ids in enumerate(prompts)])
    with torch.no_grad():
        return all(greedy_agrees(model, ids, done[f"rollout/0/{i}/0"].token_ids) for i, ids in enumerate(prompts))


def same_state(a: PolicyTrainer, b: PolicyTrainer) -> bool:
    """Master rows, moments and step of this rank, bit for bit."""
    return all(na == nb and fa == fb and torch.equal(ra, rb)
               for (na, ra, fa), (nb, rb, fb) in zip(a.state_rows(), b.state_rows(), strict=True))


step, checks, records = 0, [], []


def train_once() -> None:
    """One step of the shifted trainer (on the train ranks) and of the reference (on every rank), then
    a publish of the shifted trainer's weights."""
    global step
    if ctx.role == "train":
        ctx.trainer.train_step([scored_batch(prompts, step)])
    reference.train_step([scored_batch(prompts, step)])
    step += 1
    policy.publish_shards(ctx.trainer.weight_rows() if ctx.role == "train" else [], version=step)


def work(arrived_from: str) -> None:
    """The new role's work, checked."""
    if ctx.role == "rollout":
        assert policy.last_load["version"] == step
        checks.append(("rollout", engine_serves("rollout", policy, policy_dir)))
    elif ctx.role == "judge":
        checks.append(("judge", engine_serves("judge", judge, judge_dir)))
    else:
        # Arriving in train (and leaving it) went through storage; the state must be what the
        # reference, which never left, holds.
        checks.append(("train state before step", same_state(ctx.trainer, reference)))
        train_once()
        checks.append(("train state after step", same_state(ctx.trainer, reference)))


# Both ranks walk a path through every ordered pair (and rollout -> train -> rollout, train -> rollout
# -> train), doing each role's work on arrival.
for role in ["train", "rollout", "train", "judge", "rollout", "judge", "train"]:
    before = ctx.role
    records += ctx.apply([role, role])
    work(before)

# Resize: rank 0 leaves the train group and comes back; rank 1 trains alone meanwhile.
for roles, steps in ((["train", "train"], 1), (["judge", "train"], 2), (["train", "train"], 2)):
    records += ctx.apply(roles)
    if ctx.role == "judge":
        checks.append(("judge", engine_serves("judge", judge, judge_dir)))
    for _ in range(steps):
        train_once()
shifted, unshifted = dict(ctx.trainer.full_weights()), dict(reference.full_weights())
# Over all the weights together: k_proj's bias has an exactly zero true gradient (softmax ignores a
# shift shared by all keys), so its computed gradient is float noise that depends on how the group
# sums, and Adam turns that noise into steps of size lr on a tensor whose norm is tiny.
resize_gap = (sum((shifted[n] - w).norm() ** 2 for n, w in unshifted.items())
              / sum(w.norm() ** 2 for w in unshifted.values())).sqrt().item()

json.dump({"checks": checks, "records": records, "resize_gap": resize_gap, "steps": step},
          open(f"{out}/rank{d.rank}.json", "w"))
for s in (policy, judge, state):
    s.close()
del engines, ctx
shutdown_distributed(d)
