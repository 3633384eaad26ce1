"""The tensor-parallel process group: start-up with timeouts, and the collectives the sharded layers call."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


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
        dist.broadcast(tensor, src=0, group=self.cpu_group)
        return tensor


def free_init_addr(host: str = "127.0.0.1") -> str:
    """A HOST:PORT nobody listens on, for a single-node group's rendezvous."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def init_tp_group(rank: int, size: int, init_addr: str, timeout_s: float, device: torch.device) -> TPGroup:
    """Join the group (rendezvous at `init_addr`, rank 0 hosts it). Every serving collective gives up after
    `timeout_s`: a dead rank fails its peers instead of leaving them waiting forever."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    startup = timedelta(seconds=max(STARTUP_TIMEOUT_S, timeout_s))
    dist.init_process_group(backend, init_method=f"tcp://{init_addr}", rank=rank, world_size=size, timeout=startup)
    timeout = timedelta(seconds=timeout_s)
    math_group = dist.new_group(backend=backend, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else math_group
    return TPGroup(rank, size, device, math_group, cpu_group, dist.group.WORLD)


def destroy_tp_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

