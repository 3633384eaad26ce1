"""The tensor-parallel process group (and a tp x pp engine's mesh of them): start-up with timeouts, and the
collectives the sharded layers call."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from tandem.common.launcher.children import free_port


# Start-up (rendezvous, model loading on every rank, the pool-size exchange) may take far longer than a step.
STARTUP_TIMEOUT_S = 600.0


@dataclass
class TPGroup:
    """One rank's view of its tensor-parallel group. `cpu_group` (gloo) carries the scheduler's batches, so the
    control path never touches the device; `math_group` (NCCL on CUDA) the layers' collectives. Both time out
    after --dist-timeout; `setup_group` (the default group) after STARTUP_TIMEOUT_S, for start-up only."""

    rank: int
    size: int
    device: torch.device
    math_group: object
    cpu_group: object
    setup_group: object
    first_rank: int = 0  # the global rank of this group's rank 0 (one stage's group of a tp x pp mesh)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.math_group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `tensor` along its last dimension, in rank order."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.math_group)
        return torch.cat(parts, dim=-1)

    def broadcast_cpu(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's CPU `tensor` into every rank's (same shape and dtype)."""
        dist.broadcast(tensor, src=self.first_rank, group=self.cpu_group)
        return tensor


def free_init_addr(host: str = "127.0.0.1") -> str:
    """A HOST:PORT nobody listens on, for a single-node group's rendezvous: outside the ephemeral range, so the
    ranks spawned before rank 0 binds it (and their UCX listeners) cannot take it meanwhile."""
    return f"{host}:{free_port(host)}"


def init_tp_group(rank: int, size: int, init_addr: str, timeout_s: float, device: torch.device,
                  ranks_alive: Optional[Callable[[], None]] = None) -> TPGroup:
    """Join the group; rank 0 hosts the rendezvous store at `init_addr`. Each other rank announces itself in the
    store before the collective set-up, and rank 0 waits for every announcement calling `ranks_alive()` meanwhile
    (it raises when a rank this node started has exited), so a rank that dies before joining fails rank 0 at once.
    Every serving collective gives up after `timeout_s`: a dead rank fails its peers instead of hanging them."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    startup = timedelta(seconds=max(STARTUP_TIMEOUT_S, timeout_s))
    host, _, port = init_addr.rpartition(":")
    store = dist.TCPStore(host, int(port), size, is_master=rank == 0, timeout=startup, wait_for_workers=False)
    if rank == 0:
        _wait_for_ranks(store, size, startup.total_seconds(), ranks_alive)
    else:
        store.set(f"tandem/ready/{rank}", "1")
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=startup)
    timeout = timedelta(seconds=timeout_s)
    math_group = dist.new_group(backend=backend, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else math_group
    return TPGroup(rank, size, device, math_group, cpu_group, dist.group.WORLD)


@dataclass
class Mesh:
    """One rank's view of a tp x pp engine: global rank = pp_rank * tp_size + tp_rank (SGLang's numbering). `world`
    spans every rank (its cpu_group carries the pipeline's point-to-point messages, its setup_group the start-up
    exchanges); `tp` is this rank's stage's tensor-parallel group."""

    world: TPGroup
    tp: TPGroup


def init_mesh(rank: int, tp_size: int, pp_size: int, init_addr: str, timeout_s: float, device: torch.device,
              ranks_alive: Optional[Callable[[], None]] = None) -> Mesh:
    """Join a tp x pp engine: the world group (init_tp_group over tp_size * pp_size ranks), then one tensor-parallel
    group per stage. Every rank creates every stage's group, in stage order, as torch.distributed requires."""
    world = init_tp_group(rank, tp_size * pp_size, init_addr, timeout_s, device, ranks_alive)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    mine = None
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        math_group = dist.new_group(ranks, backend=backend, timeout=timeout)
        cpu_group = dist.new_group(ranks, backend="gloo", timeout=timeout) if backend != "gloo" else math_group
        if rank in ranks:
            mine = TPGroup(rank - ranks[0], tp_size, device, math_group, cpu_group, world.setup_group, ranks[0])
    return Mesh(world, mine)


def _wait_for_ranks(store, size: int, timeout_s: float, ranks_alive: Optional[Callable[[], None]]) -> None:
    keys = [f"tandem/ready/{r}" for r in range(1, size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if ranks_alive is not None:
            ranks_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"tensor-parallel ranks did not join within {timeout_s:.0f} s")
        time.sleep(0.05)


def destroy_tp_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

