"""A sharded publish on two ranks, either two local ranks of one node or (NODES=2) two one-rank nodes,
each node with its own replica: every replica must end up holding every rank's rows, bit for bit."""
import json
import os
import sys

import torch

out, nodes = sys.argv[1], int(sys.argv[2])
if nodes == 2:  # each rank plays a node of its own: its own buffer, replicated through the writers
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = "0", "1"

from runtime import init_distributed, shutdown_distributed  # noqa: E402
from storage import ParameterStorage, shard_rows  # noqa: E402

d = init_distributed()
shapes = [("a", (7, 3), torch.float32), ("b", (5,), torch.bfloat16), ("c", (1, 4), torch.float32)]
storage = ParameterStorage(d, "state", shapes)
ok = []
for version in (1, 2):
    gen = torch.Generator().manual_seed(version)
    full = {name: torch.randn(shape, generator=gen).to(dtype) for name, shape, dtype in shapes}
    full["a"][0, 0] = -0.0  # a sign bit that a float sum would lose
    mine = []
    for name, tensor in full.items():
        first, stop = shard_rows(tensor.shape[0], d.rank, d.world_size)
        mine.append((name, tensor[first:stop], first))
    storage.publish_shards(mine, version=version + d.rank)
    seen = dict(storage.named_tensors())
    ok.append(storage.version == version + 1 and all(
        torch.equal(seen[n].view(torch.uint8), t.view(torch.uint8)) for n, t in full.items()))
storage.close()
json.dump({"ok": ok, "node": d.node}, open(f"{out}/rank{d.rank}.json", "w"))
shutdown_distributed(d)
