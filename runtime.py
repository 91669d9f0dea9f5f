"""One way into torch.distributed for every entry point (training script, tests, benchmarks)."""
import gc
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from shifting import book


@dataclass
class Dist:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    control: dist.ProcessGroup | None  # gloo: plans, small Python objects (None once shut down)
    tensors: dist.ProcessGroup | None  # NCCL on GPU, gloo on CPU: weights and gradients
    store: dist.Store | None = None  # the launch's store (a TCPStore): signals that must not wait for a collective
    # A second client of it, for a wait that blocks a thread of the rank's own (a client serves one request
    # at a time: a wait on `store` would hold the rank's other requests behind it).
    watch: dist.Store | None = None
    # This rank and the ranks of the same local index on the other nodes, on the tensor backend: the
    # rows a rank writes to storage go to the other nodes' replicas here (None on one node).
    peers: dist.ProcessGroup | None = None
    # A slot: the --engine-tp consecutive ranks that run one rollout or judge engine and change role together
    # (shifting/book.py slot_ranks); the gloo group of this rank's slot (None at one rank a slot).
    slot_size: int = 1
    slot_group: dist.ProcessGroup | None = None

    @property
    def node(self) -> int:
        return self.rank // self.local_world_size

    @property
    def slot(self) -> int:
        return self.rank // self.slot_size

    @property
    def slots(self) -> int:
        return self.world_size // self.slot_size


def init_slots(d: Dist, size: int) -> None:
    """Lays the ranks out in slots of `size` (--engine-tp), each on one node, and makes each slot's gloo group
    (collective: every rank makes every slot's group, in order, and keeps its own)."""
    if d.local_world_size % size:
        raise SystemExit(f"--engine-tp {size} does not divide the {d.local_world_size} ranks of a node: an engine "
                         f"spans ranks of one node; pass an --engine-tp that divides --nproc_per_node")
    d.slot_size = size
    if size > 1:
        groups = [dist.new_group(list(book.slot_ranks(slot, size)), backend="gloo") for slot in range(d.slots)]
        d.slot_group = groups[d.slot]


def init_distributed() -> Dist:
    """Join the torchrun group; a plain `python` launch becomes a world of one."""
    for key, default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                         ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, default)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        store = _store()
        dist.init_process_group("nccl", device_id=device, **store)
        control = dist.new_group(backend="gloo")
    else:
        device = torch.device("cpu")
        # One thread per rank: the ranks share the machine's cores.
        torch.set_num_threads(1)
        store = _store()
        dist.init_process_group("gloo", **store)
        control = dist.group.WORLD
    world_size, local_world_size = dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    if world_size % local_world_size:
        raise SystemExit(f"{world_size} ranks in all, {local_world_size} on this node: start every node with "
                         f"the same --nproc_per_node")
    return Dist(rank=dist.get_rank(), local_rank=local_rank, world_size=world_size,
                local_world_size=local_world_size, device=device, control=control, tensors=dist.group.WORLD,
                store=store["store"], watch=store["store"].clone(),
                peers=_node_peers(local_rank, world_size, local_world_size))


def _node_peers(local_rank: int, world_size: int, local_world_size: int):
    """The group of this rank and its counterparts (the same local rank) on the other nodes; None on one
    node. Making a group is collective: every rank makes each local rank's group, in order, and keeps its own."""
    nodes = world_size // local_world_size
    if nodes == 1:
        return None
    groups = [dist.new_group([node * local_world_size + index for node in range(nodes)])
              for index in range(local_world_size)]
    return groups[local_rank]


def shutdown_distributed(d: Dist) -> None:
    """Once every rank is here, destroys the groups and lets their worker threads go (holders of other
    groups, such as a trainer's, must have dropped them before)."""
    # vLLM's engine tears the default group down with itself; only destroy what is left, once every rank
    # is here (a rank destroying its group while a peer still uses it can abort that peer).
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    # A gloo group joins its worker threads only when its last reference goes. Held until the
    # interpreter exits, a worker still releasing its last collective's tensors asks for the GIL
    # while the interpreter finalizes, and the process dies in std::terminate (seen about once in 15
    # launches). Dropping ours here joins them first.
    d.control = d.tensors = d.store = d.watch = d.peers = d.slot_group = None
    gc.collect()


def cpu_ticks() -> tuple[int, int] | None:
    """This machine's (busy, total) CPU ticks since boot, every process counted, from /proc/stat; None
    where there is none. Two readings give the busy fraction in between."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return None
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # all but idle and iowait


def busy_fraction(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    if before is None or after is None or after[1] == before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def _store() -> dict:
    """The launch's store, with each launch's keys under their own prefix: under torchrun with
    --max-restarts a restarted group is handed the same store (the torchrun agent's) as the launch
    before it, still holding that launch's keys, and without the prefix a restarted rank reads a dead
    peer's address and fails to connect."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store, rank, world_size = next(dist.rendezvous("env://"))
    return {"store": dist.PrefixStore(f"pivotrl/launch-{attempt}/", store), "rank": rank, "world_size": world_size}


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
