"""How a request's KV slots move between the request, the tree cache and the allocator."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from tandem.common.memory.chunk_cache import ChunkCache
from tandem.common.memory.hiradix_cache import HiRadixCache

if TYPE_CHECKING:
    from tandem.common.memory.allocator import PagedTokenToKVPoolAllocator
    from tandem.common.memory.radix_cache import CacheNamespace
    from tandem.common.memory.req_to_token import ReqToTokenPool
    from tandem.common.scheduler.req import Req


class KVCacheOps:
    """Owns the three memory structures a scheduler touches and keeps their invariants together:
    every KV slot is owned either by the tree cache, by exactly one request, or is free."""

    def __init__(self, req_to_token_pool: "ReqToTokenPool", allocator: "PagedTokenToKVPoolAllocator",
                 tree_cache, page_size: int):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.page_size = page_size
        self.caching = not isinstance(tree_cache, ChunkCache)
        self.hierarchical = isinstance(tree_cache, HiRadixCache)

    def shares(self, req: "Req") -> bool:
        """Whether the request's KV goes through the tree cache: always, except under an adapter unloaded since
        the request was admitted (its prefixes are being dropped, so it neither matches nor publishes more)."""
        return self.caching and (req.lora is None or not req.lora.unloaded)

    @staticmethod
    def namespace(req: "Req") -> Optional["CacheNamespace"]:
        """The tree's namespace for the request: a LoRA request's KV depends on its adapter, so it only ever meets
        prefixes computed under the same adapter (None: the base model's)."""
        return None if req.lora is None else req.lora.cache_namespace

    def drop_namespace(self, namespace: "CacheNamespace") -> int:
        """Free the unlocked prefixes cached under an unloaded adapter; return tokens freed."""
        return self.tree_cache.drop_namespace(namespace) if self.caching else 0

    def _drop_if_unloaded(self, req: "Req") -> None:
        """Prefixes this request kept locked past its adapter's unload can go now."""
        if self.caching and req.lora is not None and req.lora.unloaded:
            self.tree_cache.drop_namespace(req.lora.cache_namespace)

    def _kv_indices(self, req: "Req", length: int) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[req.req_pool_idx, :length].clone()

    def match_prefix(self, req: "Req") -> None:
        """Point the request at the longest cached prefix of its fill_ids (no locks taken yet)."""
        req.fill_ids = req.all_ids()
        req.is_chunked = False
        if self.shares(req):
            match = self.tree_cache.match_prefix(req.fill_ids[: req.max_prefix_len()], record_stats=False,
                                                 namespace=self.namespace(req))
            req.prefix_indices, req.last_node = match.device_indices, match.last_node
            if self.hierarchical:
                req.loaded_tokens["host"] += match.host_tokens
                req.loaded_tokens["disk"] += match.disk_tokens
        req.extend_input_len = len(req.fill_ids) - len(req.prefix_indices)

    def prefetch(self, reqs: list["Req"]) -> list["Req"]:
        """Requests just received: HiCache starts reading their prefixes' storage pages now, so that what has
        arrived by the time they are scheduled is used (--hicache-storage-prefetch-policy). Returns `reqs`."""
        if self.hierarchical:
            for req in reqs:
                if self.shares(req):
                    ids = req.all_ids()  # its last token is always computed
                    self.tree_cache.prefetch(ids[: len(ids) - 1], self.namespace(req))
        return reqs

    def record_admission(self, req: "Req") -> None:
        """Count a request's prefix hit once, when it is first admitted (not on re-admission)."""
        if req.matched_once:
            return
        req.matched_once = True
        req.cached_tokens = len(req.prefix_indices)  # from any tier: HiCache loaded them onto the device
        if self.hierarchical and req.last_node is not None:
            self.tree_cache.record_admission(req.last_node, req.cached_tokens, req.loaded_tokens)
        self.tree_cache.hit_tokens += len(req.prefix_indices)
        self.tree_cache.queried_tokens += len(req.origin_input_ids)

    def lock(self, req: "Req") -> int:
        """Lock the request's matched prefix; return the cached tokens that stopped being evictable (so no longer
        count as available)."""
        if self.caching and req.last_node is not None:
            return self.tree_cache.inc_lock_ref(req.last_node)
        return 0

    def lockable_tokens(self, req: "Req") -> int:
        """The evictable tokens that locking the request's matched prefix would take out of the available ones."""
        if self.caching and req.last_node is not None:
            return self.tree_cache.unlocked_tokens_on_path(req.last_node)
        return 0

    def unlock(self, req: "Req") -> None:
        if self.caching and req.last_node is not None:
            self.tree_cache.dec_lock_ref(req.last_node)

    def _insert(self, req: "Req", tokens: list[int], kv_indices: torch.Tensor) -> int:
        """Insert the page-aligned part; free our duplicate slots; return the aligned length."""
        aligned = len(tokens) // self.page_size * self.page_size
        prefix_len = len(req.prefix_indices)
        present = self.tree_cache.insert(tokens[:aligned], kv_indices[:aligned], self.namespace(req))
        if present > prefix_len:
            self.allocator.free(kv_indices[prefix_len:present])
        return aligned

    def cache_unfinished(self, req: "Req") -> None:
        """After a prefill chunk: publish its full pages to the tree so later requests can reuse them,
        and move the request's lock to the new deepest node."""
        if not self.shares(req):
            return
        tokens = req.fill_ids[: req.kv_len]
        kv_indices = self._kv_indices(req, req.kv_len)
        aligned = self._insert(req, tokens, kv_indices)
        match = self.tree_cache.match_prefix(tokens[:aligned], record_stats=False, namespace=self.namespace(req))
        new_indices = match.device_indices
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        row[len(req.prefix_indices): len(new_indices)] = new_indices[len(req.prefix_indices):]
        self.tree_cache.inc_lock_ref(match.last_node)
        self.unlock(req)
        req.prefix_indices, req.last_node = new_indices, match.last_node

    def cache_finished(self, req: "Req") -> None:
        """The request is done: keep its KV in the tree (or free it) and return its slot."""
        if req.req_pool_idx is None:
            return
        kv_indices = self._kv_indices(req, req.kv_len)
        if self.shares(req):
            tokens = req.all_ids()[: req.kv_len]
            aligned = self._insert(req, tokens, kv_indices)
            if len(kv_indices) > aligned:
                self.allocator.free(kv_indices[aligned:])
            self.unlock(req)
        else:
            self.allocator.free(kv_indices[len(req.prefix_indices):])
            self.unlock(req)
            self._drop_if_unloaded(req)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    def release(self, req: "Req") -> None:
        """Drop the request's own KV without caching it (retraction, abort before completion)."""
        if req.req_pool_idx is None:
            return
        kv_indices = self._kv_indices(req, req.kv_len)
        own = kv_indices[len(req.prefix_indices):]
        if len(own):
            self.allocator.free(own)
        self.unlock(req)
        self._drop_if_unloaded(req)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    def evict_for(self, num_tokens: int) -> bool:
        """Make `num_tokens` allocatable if possible, evicting unlocked cached prefixes."""
        short = num_tokens - self.allocator.available_size()
        if short > 0 and self.caching:
            self.tree_cache.evict(short)
        return self.allocator.available_size() >= num_tokens

    def available_tokens(self) -> int:
        evictable = self.tree_cache.evictable_size() if self.caching else 0
        return self.allocator.available_size() + evictable
