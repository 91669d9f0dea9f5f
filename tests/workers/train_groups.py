"""Three ranks move through train groups of every size; the role context keeps only the current and the
previous one and destroys the others on every rank. Each arrival in train loads the stored state bit for
bit, over a group kept, remade after it was destroyed, or new. No engines: the train role alone."""
import json
import sys

import torch
import torch.distributed as dist

from roles.rollout import Sample
from roles.trainer import PolicyTrainer
from runtime import init_distributed, shutdown_distributed
from shifting.context import RoleContext
from storage import ParameterStorage, TrainState

PATH = [["train", "train", "judge"], ["judge", "train", "train"], ["train", "train", "judge"],
        ["train", "judge", "train"], ["train", "judge", "judge"], ["train", "train", "train"],
        ["judge", "train", "train"]]

policy_dir, out = sys.argv[1:3]
d = init_distributed()
hyper = dict(lr=1e-3, weight_decay=0.01, grad_clip=1.0, temperature=1.0, micro_batch=2)
state = TrainState(d, policy_dir, keep_reference=False)
policy = ParameterStorage(d, "policy", state.weight_shapes(torch.float32))
ctx = RoleContext(d, PATH[0], policy=policy, judge=None, train_state=state, rollout_engine=None, judge_engine=None,
                  make_trainer=lambda group: PolicyTrainer(state, group, d.device, **hyper))


def batch(step: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(step)
    return [Sample(i, g, [3, 4, 5 + i], torch.randint(2, 64, (2 + i,), generator=gen).tolist(), [-3.0] * (2 + i),
                   "length", advantage=1.0 if (i + g + step) % 2 else -1.0) for i in range(3) for g in range(2)]


def loaded_stored_state() -> bool:
    """The trainer's rows of master weights, moments and step are the stored ones, bit for bit."""
    return all(torch.equal(rows, state.view(name)[first:first + rows.shape[0]])
               for name, rows, first in ctx.trainer.state_rows())


kept, loads, made = [], [], {}
for step, roles in enumerate(PATH):
    if step:
        ctx.apply(roles)
    kept.append([list(key) for key in ctx.groups])
    for key, group in ctx.groups.items():
        if d.rank in key:
            made.setdefault(key, [])
            if not any(group is g for g in made[key]):
                made[key].append(group)
    if ctx.trainer is not None:
        loads.append(loaded_stored_state())
        ctx.trainer.train_step([batch(step)])

current = {key: group for key, group in ctx.groups.items() if d.rank in key}
destroyed, alive = 0, 0
for key, groups in made.items():
    for group in groups:
        try:
            dist.get_process_group_ranks(group)
            alive += 1
        except (KeyError, ValueError, RuntimeError):
            destroyed += 1
json.dump({"kept": kept, "loads": loads, "made": {",".join(map(str, k)): len(g) for k, g in made.items()},
           "alive": alive, "destroyed": destroyed, "current": len(current)},
          open(f"{out}/rank{d.rank}.json", "w"))
for held in (policy, state):
    held.close()
del ctx
shutdown_distributed(d)
