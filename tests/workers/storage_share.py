"""Two local ranks share one published copy: rank 0 (the node's writer) publishes, rank 1 reads it. Each
rank hands its own tensors (seeded by version and rank), so what rank 1 reads shows whose copy it is."""
import glob
import json
import sys

import torch

from runtime import init_distributed, shutdown_distributed
from storage import ParameterStorage

SHAPES = [("a.weight", (3, 5), torch.float32), ("b.bias", (7,), torch.float32), ("c", (2, 2), torch.bfloat16)]


def handed(version: int, rank: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 * version + rank)
    return [(name, torch.randn(shape, generator=gen).to(dtype)) for name, shape, dtype in SHAPES]


if __name__ == "__main__":
    d = init_distributed()
    storage = ParameterStorage(d, "policy", SHAPES)
    seen = {"name_left_in_shm": bool(glob.glob(storage.path)), "versions": []}
    for version in (1, 2):
        storage.publish(iter(handed(version, d.rank)), version)
        seen["versions"].append({"version": storage.version, "tensors": {
            name: t.float().flatten().tolist() for name, t in storage.named_tensors()}})
    storage.close()
    json.dump(seen, open(f"{sys.argv[1]}/rank{d.rank}.json", "w"))
    shutdown_distributed(d)
