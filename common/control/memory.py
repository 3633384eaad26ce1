"""Releasing and restoring one process's KV pool and weights for a colocated trainer (every tensor-parallel rank
runs the same on its own shard)."""

from __future__ import annotations

import os
import tempfile
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from tandem.common.model.cpu_linear import drop_packed_weights

MEMORY_TAGS = ("kv_cache", "weights")


def tags_mask(tags: list[str]) -> int:
    return sum(1 << MEMORY_TAGS.index(t) for t in tags)


def mask_tags(mask: int) -> list[str]:
    return [t for i, t in enumerate(MEMORY_TAGS) if mask & (1 << i)]


class MemoryOccupation:
    """The KV pool's buffers and the model's parameters, emptied and restored in place (the model and the pool keep
    their objects, so nothing holding them needs to know). Call only while no forward pass runs."""

    def __init__(self, kv_pool, params: dict[str, torch.nn.Parameter], device: torch.device,
                 model: Optional[torch.nn.Module] = None):
        """`model`: the module holding `params`, whose packed CPU weight copies go with the weights."""
        self.kv_pool = kv_pool
        self.params = params
        self.model = model
        self.device = device
        self._weights_backup: Optional[str] = None

    def release(self, tags: list[str]) -> None:
        if "kv_cache" in tags:
            pool = self.kv_pool
            pool.k_buffers = [b.new_empty(0) for b in pool.k_buffers]
            pool.v_buffers = [b.new_empty(0) for b in pool.v_buffers]
        if "weights" in tags:
            # The tensors go to a file (host RAM is what CPU weights occupy), device memory is freed.
            fd, path = tempfile.mkstemp(prefix="tandem-weights-", suffix=".safetensors")
            os.close(fd)
            save_file({n: p.data.contiguous() for n, p in self.params.items()}, path)
            for p in self.params.values():
                p.data = p.data.new_empty(0)
            if self.model is not None:
                drop_packed_weights(self.model)  # rebuilt from the restored weights on the first forward after
            self._weights_backup = path
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume(self, tags: list[str]) -> None:
        if "weights" in tags and self._weights_backup is not None:
            saved = load_file(self._weights_backup, device=str(self.device))
            for n, p in self.params.items():
                p.data = saved[n]
            os.unlink(self._weights_backup)
            self._weights_backup = None
        if "kv_cache" in tags:
            self.kv_pool.allocate()
