"""Two local ranks share one published copy: rank 0 (the node's writer) publishes, rank 1 reads it."""
import glob
import json
import sys

import torch

from runtime import init_distributed, shutdown_distributed
from storage import ParameterStorage

d = init_distributed()
shapes = [("a.weight", (3, 5), torch.float32), ("b.bias", (7,), torch.float32), ("c", (2, 2), torch.bfloat16)]
storage = ParameterStorage(d, "policy", shapes)
assert not glob.glob(storage.path), "the name should be gone once every local rank has mapped it"
for version in (1, 2):
    # Every rank hands the same full tensors, as the trainer's gather does.
    gen = torch.Generator().manual_seed(version)
    weights = [(name, torch.randn(shape, generator=gen).to(dtype)) for name, shape, dtype in shapes]
    storage.publish(iter(weights), version)
    seen = dict(storage.named_tensors())
    assert storage.version == version, storage.version
    for name, tensor in weights:
        assert torch.equal(seen[name], tensor), name
storage.close()
json.dump({"versions_seen": [1, 2]}, open(f"{sys.argv[1]}/rank{d.rank}.json", "w"))
shutdown_distributed(d)
