"""A checkpoint of the training state written to disk and read back, and the policy exported as a Hugging
Face directory: the bytes come back exactly, and the process's peak resident memory grows by far less
than the state (no full copy on the way)."""
import hashlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

import checkpoint
import export
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


def rise_kb(work) -> int:
    """How far the resident memory's peak during `work()` rises above the resident memory before it:
    Linux resets the peak (VmHWM) to the current resident size when 5 is written to clear_refs
    (proc(5)), so what earlier code allocated and freed does not hide what `work` allocates."""
    def status(key):
        return int(next(line for line in open("/proc/self/status") if line.startswith(key)).split()[1])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS:")
    work()
    return status("VmHWM:") - before


# Shards of 50 MB: the index and several files, as a large model gets them.
exported = rise_kb(lambda: export.write_model(d, train_state, policy, out / "model", max_shard_bytes=50 * 10**6))
saved = rise_kb(lambda: checkpoint.save(d, out, 1, train_state, SimpleNamespace(trainer=None), policy))  # no trainer
state.buffer[64:].fill_(7)
restored = rise_kb(lambda: checkpoint.restore(d, checkpoint.latest(out), train_state))
json.dump({"nbytes": state.nbytes, "exported_kb": exported, "saved_kb": saved, "restored_kb": restored,
           "exact": hashlib.sha256(memoryview(state.buffer.numpy())).hexdigest() == digest},
          open(out / "memory.json", "w"))
train_state.close()
shutdown_distributed(d)
