"""Prefix cache stand-in for when prefix caching is off: same interface as RadixCache, caches nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tandem.common.memory.radix_cache import KVCacheEvent, MatchResult, TreeNode

if TYPE_CHECKING:
    from tandem.common.memory.allocator import PagedTokenToKVPoolAllocator


class ChunkCache:
    """Never matches, never keeps slots: callers free everything they allocated themselves."""

    disable = True
    enable_events = False

    def __init__(self, allocator: PagedTokenToKVPoolAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self.device = allocator.device
        self.root = TreeNode()
        self.root.lock_ref = 1
        self.root.value = torch.empty(0, dtype=torch.int64, device=self.device)
        self.hit_tokens = 0
        self.queried_tokens = 0

    def match_prefix(self, key: list[int], *, record_stats: bool = True, namespace=None) -> MatchResult:
        return MatchResult(self.root.value, self.root)

    def insert(self, key: list[int], value: torch.Tensor, namespace=None) -> int:
        """Keeps nothing: the caller still owns (and frees) all of ``value``."""
        return 0

    def inc_lock_ref(self, node: TreeNode) -> int:
        return 0

    def dec_lock_ref(self, node: TreeNode) -> int:
        return 0

    def unlocked_tokens_on_path(self, node: TreeNode) -> int:
        return 0  # nothing is cached, so a lock takes nothing out of the evictable tokens

    def evict(self, num_tokens: int, roots=None) -> int:
        return 0

    def drop_namespace(self, namespace) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def hit_rate(self) -> float:
        return 0.0

    def reset(self) -> None:
        pass

    def take_events(self) -> list[KVCacheEvent]:
        return []

    def pretty_print(self) -> str:
        text = "#tokens: 0 (chunk cache)"
        print(text)
        return text
