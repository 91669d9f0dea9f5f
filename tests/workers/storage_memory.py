"""Resident memory of a published storage on each local rank, read from /proc/self/smaps: Rss counts
the shared pages a rank touches, Pss splits each page between the ranks that map it."""
import json
import sys

import torch
import torch.distributed as dist

from runtime import init_distributed, shutdown_distributed
from storage import ParameterStorage

out, mib = sys.argv[1], int(sys.argv[2])
d = init_distributed()
storage = ParameterStorage(d, "policy", [("w", (mib << 18,), torch.float32)])
storage.publish([("w", torch.ones(mib << 18))], version=1)
assert storage.views["w"].sum().item() == mib << 18  # every rank reads every page


def mapping_kb(path: str) -> dict:
    found, kb = False, {"Rss": 0, "Pss": 0}
    for line in open("/proc/self/smaps"):
        if "-" in line.split()[0] and len(line.split()) >= 5:  # a mapping's header line
            found = path in line
        elif found and line.split(":")[0] in kb:
            kb[line.split(":")[0]] += int(line.split()[1])
    return kb


# Measured while every rank maps the buffer: one rank letting go early would hand its share to the others.
dist.barrier()
json.dump({**mapping_kb(storage.path), "nbytes": storage.nbytes}, open(f"{out}/rank{d.rank}.json", "w"))
dist.barrier()
storage.close()
shutdown_distributed(d)
