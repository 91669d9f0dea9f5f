"""Sharded publishes on one node or on NODES nodes played by the ranks of one machine (the world split
into NODES blocks of consecutive ranks, each with its own replica). Some publishes have every rank
write, some one rank, some a few rows, some no rank at all, as a run's weight publishes and
training-state saves do. After each, every replica must hold exactly what was written, bit for bit,
and rows no rank wrote must keep what they held. Writes, per publish, what this rank saw."""
import json
import os
import sys

import torch

out, nodes = sys.argv[1], int(sys.argv[2])
# Each block of ranks plays a node of its own: its own buffer, replicated through the peer groups.
local_world_size = int(os.environ["WORLD_SIZE"]) // nodes
os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
os.environ["LOCAL_RANK"] = str(int(os.environ["RANK"]) % local_world_size)

from runtime import init_distributed, shutdown_distributed  # noqa: E402
from storage import ParameterStorage, shard_rows  # noqa: E402

d = init_distributed()
shapes = [("a", (7, 3), torch.float32), ("b", (5,), torch.bfloat16), ("c", (1, 4), torch.float32),
          ("d", (9, 2), torch.int64)]
storage = ParameterStorage(d, "state", shapes)
held = {name: torch.zeros(shape, dtype=dtype) for name, shape, dtype in shapes}
version = 0


def fresh(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    full = {name: (torch.randn(shape, generator=gen) * 100).to(dtype) for name, shape, dtype in shapes}
    full["a"][0, 0] = -0.0  # a sign bit that a float sum would lose
    full["a"][1, 1] = float("nan")
    return full


def shards(full: dict[str, torch.Tensor], writers: list[int]) -> list:
    """This rank's Shard(0) rows of every tensor over `writers` (a train group), as a trainer writes."""
    if d.rank not in writers:
        return []
    index = writers.index(d.rank)
    return [(name, t[first:stop], first) for name, t in full.items()
            for first, stop in [shard_rows(t.shape[0], index, len(writers))]]


world = list(range(d.world_size))
publishes = [  # (what, the rows each rank writes)
    ("every rank writes", lambda: shards(fresh(1), world)),
    ("no rank writes", lambda: []),
    ("the last rank writes all", lambda: shards(fresh(2), world[-1:])),
    ("rank 0 writes rows 2..5 of a", lambda: [("a", fresh(3)["a"][2:5], 2)] if d.rank == 0 else []),
    ("every rank but rank 0 writes", lambda: shards(fresh(4), world[1:])),
    ("no rank writes", lambda: []),
]
seen = []
for step, (what, rows) in enumerate(publishes, start=1):
    mine = rows()
    claims = [None] * d.world_size
    torch.distributed.all_gather_object(claims, mine, group=d.control)
    for name, part, first in (row for claim in claims for row in claim):
        held[name][first:first + part.shape[0]] = part
    if any(claims):
        version = max(step + rank for rank, claim in enumerate(claims) if claim)
    storage.publish_shards(mine, version=step + d.rank)
    stored = dict(storage.named_tensors())
    seen.append({"what": what, "version_ok": storage.version == version,
                 "exact": all(torch.equal(stored[n].view(torch.uint8), t.view(torch.uint8)) for n, t in held.items()),
                 "expected_bytes": sum(t.numel() * t.element_size() for claim in claims for _, t, _ in claim),
                 **storage.last_publish})
storage.close()
json.dump({"node": d.node, "publishes": seen}, open(f"{out}/rank{d.rank}.json", "w"))
shutdown_distributed(d)
