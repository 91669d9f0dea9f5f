"""Every collective on a tensor group (the world's tensor group and the train groups made from it) must
take tensors on the group's device: on GPU those groups are NCCL, which refuses host tensors. On CPU every
tensor is on the host, so this run tells them apart another way. A tensor made without a device argument
(`torch.zeros(2)`, `torch.tensor([x, y])`) is where it would be on a GPU, on the host, and so is what is
computed from host tensors alone; `.to(device)` or a device argument puts a tensor on the device. Every
collective on a group other than the control group (gloo on GPU too) is checked for host tensors, and an
op that mixes a host tensor (not 0-d) with a device one, which CUDA refuses, is recorded as well.

The checker first proves it can fail, on known snippets; then the real trainer steps over the real gloo
group of two ranks, then over a train group of one made by the role context, then over both again."""
import inspect
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from roles.trainer import PolicyTrainer
from batches import scored_batch
from runtime import init_distributed, shutdown_distributed
from shifting.context import RoleContext
from storage import ParameterStorage, TrainState

COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_coalesced",
               "all_gather_into_tensor", "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
               "reduce_scatter_single", "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv",
               "isend", "irecv")
HERE = str(Path(__file__).resolve())


def caller() -> str:
    """The innermost frame outside this file and outside torch: where the code under test made the call."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename != HERE and "/torch/" not in frame.filename:
            return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"
    return "?"


class HostTensors(TorchFunctionMode):
    """While active: tracks which tensors would be on the host on a GPU, and checks the collectives."""

    def __init__(self, control):
        super().__init__()
        self.control = control
        self.host = WeakIdKeyDictionary()
        self.problems, self.checked = [], []
        self.saved = {}

    def __enter__(self):
        for name in COLLECTIVES:
            self.saved[name] = getattr(dist, name)
            setattr(dist, name, self._checked(name, self.saved[name]))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, collective in self.saved.items():
            setattr(dist, name, collective)
        return super().__exit__(*exc)

    def is_host(self, tensor) -> bool:
        return tensor in self.host

    def _checked(self, name, collective):
        signature = inspect.signature(collective)

        def checked(*args, **kwargs):
            arguments = signature.bind(*args, **kwargs).arguments
            if arguments.get("group") is not self.control:
                host = [t for t in tree_leaves(list(arguments.values()))
                        if isinstance(t, torch.Tensor) and self.is_host(t)]
                self.checked.append(name)
                if host:
                    self.problems.append(f"{name} of a host tensor {list(host[0].shape)} on a tensor group, "
                                         f"at {caller()}")
            return collective(*args, **kwargs)
        return checked

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        host = self._on_host(func, args, kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                if host:
                    self.host[t] = True
                else:
                    self.host.pop(t, None)
        return out

    def _on_host(self, func, args, kwargs) -> bool:
        """Whether `func`'s result would be on the host on a GPU."""
        if func is torch.Tensor.cpu:
            return True
        if func is torch.Tensor.to:
            given = [a for a in args[1:] if isinstance(a, (str, torch.device, torch.Tensor))]
            target = kwargs.get("device", given[0] if given else None)
            if isinstance(target, torch.Tensor):
                return self.is_host(target)
            return self.is_host(args[0]) if target is None else False
        if func in (torch.Tensor.copy_, torch.Tensor.__setitem__):
            return self.is_host(args[0])  # the destination stays where it is
        if kwargs.get("device") is not None:
            return False
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not inputs:
            return True  # made here without a device: on the host
        host = [t for t in inputs if self.is_host(t)]
        if host and len(host) < len(inputs) and any(t.dim() > 0 for t in host):
            self.problems.append(f"{getattr(func, '__name__', func)} mixes a host tensor with a device tensor, "
                                 f"at {caller()}")
        return len(host) == len(inputs)


def self_check(d) -> dict:
    """Known snippets, each flagged or not as it would fail on GPU or not."""
    snippets = {
        "host tensor all-reduced": (True, lambda: dist.all_reduce(torch.zeros(2), group=d.tensors)),
        "host tensor summed, then all-reduced": (True, lambda: dist.all_reduce(torch.zeros(2) + torch.ones(2),
                                                                               group=d.tensors)),
        "device tensor all-reduced": (False, lambda: dist.all_reduce(torch.zeros(2, device=d.device),
                                                                     group=d.tensors)),
        "host tensor moved, then all-reduced": (False, lambda: dist.all_reduce(torch.zeros(2).to(d.device),
                                                                               group=d.tensors)),
        "host tensor on the control group": (False, lambda: dist.all_reduce(torch.zeros(2), group=d.control)),
        "host tensor added into a device tensor": (True, lambda: torch.zeros(2, device=d.device).add_(torch.ones(2))),
        "host scalar times a device tensor": (False, lambda: torch.ones(2, device=d.device) * torch.tensor(2.0)),
    }
    flagged = {}
    for name, (expected, run) in snippets.items():
        with HostTensors(d.control) as mode:
            run()
        flagged[name] = [expected, bool(mode.problems)]
    return flagged


policy_dir, out = sys.argv[1:3]
d = init_distributed()
# As on GPU: control messages on a gloo group of their own, tensors on the world's group.
d.control = dist.new_group(backend="gloo")
result = {"self_check": self_check(d)}
hyper = dict(lr=1e-3, weight_decay=0.01, grad_clip=1.0, temperature=1.0, micro_batch=2)
state = TrainState(d, policy_dir, keep_reference=False)
policy = ParameterStorage(d, "policy", state.weight_shapes(torch.float32))
prompts = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]
with HostTensors(d.control) as mode:
    ctx = RoleContext(d, ["train", "train"], policy=policy, judge=None, train_state=state, rollout_engine=None,
                      judge_engine=None, make_trainer=lambda group: PolicyTrainer(state, group, d.device, **hyper))
    for step, roles in enumerate((["train", "train"], ["judge", "train"], ["train", "train"])):
        ctx.apply(roles)
        if ctx.trainer is not None:
            ctx.trainer.train_step([scored_batch(prompts, step)])
        policy.publish_shards(ctx.trainer.weight_rows() if ctx.trainer is not None else [], version=step + 1)
result.update(problems=mode.problems, checked=sorted(set(mode.checked)))
json.dump(result, open(f"{out}/rank{d.rank}.json", "w"))
for held in (policy, state):
    held.close()
del ctx
shutdown_distributed(d)
