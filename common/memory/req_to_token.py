"""ReqToTokenPool: one row per running request mapping its token positions to KV pool slots."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """A fixed table [size, max_context_len] of KV slot indices plus a free list of request rows."""

    def __init__(self, size: int, max_context_len: int, device: torch.device | str = "cpu"):
        if size < 1 or max_context_len < 1:
            raise ValueError(f"ReqToTokenPool needs size >= 1 and max_context_len >= 1, got {size}, {max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=self.device)
        # Pop from the end: lowest rows are handed out first.
        self._free_slots = list(range(size - 1, -1, -1))
        self._is_free = [True] * size

    def available_size(self) -> int:
        return len(self._free_slots)

    def alloc(self) -> int | None:
        """One free request row, or None when every row is taken."""
        if not self._free_slots:
            return None
        slot = self._free_slots.pop()
        self._is_free[slot] = False
        return slot

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.size:
            raise ValueError(f"request slot {slot} is out of range [0, {self.size})")
        if self._is_free[slot]:
            raise ValueError(f"request slot {slot} is already free (double free)")
        self._is_free[slot] = True
        self._free_slots.append(slot)

    def clear(self) -> None:
        self._free_slots = list(range(self.size - 1, -1, -1))
        self._is_free = [True] * self.size
