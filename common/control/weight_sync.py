"""The torch.distributed group a trainer broadcasts weights over: the same rendezvous on both ends (a TCPStore at
the trainer, rank 0, prefixed by the group's name), so a trainer calls `join_group` exactly as the worker does."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tandem.common.errors import WeightUpdateError

BACKENDS = ("gloo",)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class WeightsGroup:
    """One process group: this process's rank in it and the store that keeps the rendezvous alive."""

    name: str
    rank: int
    world_size: int
    group: "dist.ProcessGroup"
    store: "dist.Store"

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Receive (or, at `src`, send) `tensor` in place; blocks until every rank took part."""
        options = dist.BroadcastOptions()
        options.rootRank = src
        self.group.broadcast([tensor], options).wait()
        return tensor


def join_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str = "gloo", timeout_s: float = 60.0) -> WeightsGroup:
    """Rendezvous at master_address:master_port (rank 0 hosts the store) and build the group; blocks until all
    `world_size` ranks arrive or `timeout_s` passes."""
    if backend not in BACKENDS:
        raise WeightUpdateError(f"backend {backend!r} is not supported; use one of {', '.join(BACKENDS)} (nccl needs "
                                "CUDA on both ends and is not built)")
    if not 0 <= rank < world_size:
        raise WeightUpdateError(f"rank_offset {rank} must be below world_size {world_size}")
    if not group_name:
        raise WeightUpdateError("group_name must not be empty")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
        group = dist.ProcessGroupGloo(dist.PrefixStore(f"{group_name}/", store), rank, world_size, timeout)
    except (RuntimeError, OSError) as e:  # DistStoreError is a RuntimeError
        raise WeightUpdateError(f"cannot join weights group {group_name!r} at {master_address}:{master_port} as "
                                f"rank {rank} of {world_size}: {e}") from e
    return WeightsGroup(group_name, rank, world_size, group, store)


def receive(group: WeightsGroup, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict:
    """The named tensors broadcast by rank 0, in order (the trainer broadcasts them in the same order)."""
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise WeightUpdateError(f"names, dtypes and shapes must be non-empty and of equal length, got "
                                f"{len(names)}, {len(dtypes)}, {len(shapes)}")
    bad = next((d for d in dtypes if d.replace("torch.", "") not in DTYPES), None)
    if bad is not None:
        raise WeightUpdateError(f"dtypes: {bad!r} is not one of {', '.join(DTYPES)}")
    tensors = {}
    for name, dtype, shape in zip(names, dtypes, shapes):
        tensors[name] = group.broadcast(torch.empty(shape, dtype=DTYPES[dtype.replace("torch.", "")]))
    return tensors
