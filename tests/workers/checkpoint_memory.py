"""A checkpoint of the training state written to disk and read back: the bytes come back exactly, and the
process's peak resident memory grows by far less than the state (no full copy on the way)."""
import hashlib
import json
import resource
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

import checkpoint
from runtime import init_distributed, shutdown_distributed
from storage import TrainState

out, policy = Path(sys.argv[1]), sys.argv[2]
d = init_distributed()
train_state = TrainState(d, policy, keep_reference=False)
state = train_state.state
# Moments unlike the weights, and every page of the buffer touched, so it is all resident before measuring.
gen = torch.Generator().manual_seed(0)
state.publish_shards([(f"{field}/{name}", torch.rand(shape, generator=gen), 0)
                      for field in ("exp_avg", "exp_avg_sq") for name, shape in train_state.params], version=1)
digest = hashlib.sha256(memoryview(state.buffer.numpy())).hexdigest()


def peak_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


before = peak_kb()
checkpoint.save(d, out, 1, train_state, SimpleNamespace(trainer=None))  # a context whose rank holds no trainer
saved = peak_kb()
state.buffer[64:].fill_(7)
checkpoint.restore(d, checkpoint.latest(out), train_state)
restored = peak_kb()
json.dump({"nbytes": state.nbytes, "before_kb": before, "saved_kb": saved, "restored_kb": restored,
           "exact": hashlib.sha256(memoryview(state.buffer.numpy())).hexdigest() == digest},
          open(out / "memory.json", "w"))
train_state.close()
shutdown_distributed(d)
