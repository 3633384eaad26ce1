"""HiRadixCache: the RadixCache over three tiers — device slots (L1), a host pool (L2), a storage backend (L3)."""

from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from tandem.common.memory.cache_events import AllCleared, BlockRemoved
from tandem.common.memory.hicache_io import StorageIO
from tandem.common.memory.hicache_page import PageFormatError, PageLayout, decode_page
from tandem.common.memory.host_pool import HostKVPool
from tandem.common.memory.page_hash import block_hash
from tandem.common.memory.radix_cache import CacheNamespace, MatchResult, RadixCache, TreeNode
from tandem.common.telemetry.metrics import HiCacheMetrics

logger = logging.getLogger(__name__)

SELECTIVE_HITS = 2  # write_through_selective: admissions that must reuse a node before it gets a host copy


@dataclass
class HiMatchResult(MatchResult):
    host_tokens: int = 0  # of the match, tokens just loaded back from the host pool
    disk_tokens: int = 0  # ... and from storage


@dataclass
class TierCounters:
    """Tokens loaded and reused per tier since start, and bad pages seen (Engine.memory_report reads them)."""

    loaded: dict = field(default_factory=lambda: {"host": 0, "disk": 0})
    hits: dict = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    corrupt_pages: int = 0


class HiRadixCache(RadixCache):
    """A node's KV lives on the device (`value`), in the host pool (`host_value`), or both; L3 holds pages by
    storage key, outside the tree.

    Invariants: a node without device slots has host slots, and so do all its descendants (device-evicted nodes
    form subtrees under the device tree, so every locked path is on the device); the host pool's used tokens equal
    the tree's host slots; evictable/protected sizes count device tokens only.

    L1 eviction demotes: the node keeps (or first gets) its host copy and drops its device slots. L2 eviction writes
    the page to L3 (when there is a backend) and drops the host copy; a node with neither copy leaves the tree.
    Copies read device KV only from unlocked nodes: a locked node may still be computed by the forward in flight
    (the overlap loop), so a write-through copy waits in `_pending` until its node is unlocked.
    """

    def __init__(self, allocator, page_size: int, host_pool: HostKVPool, write_policy: str,
                 storage_io: Optional[StorageIO] = None, enable_events: bool = False,
                 metrics: Optional[HiCacheMetrics] = None):
        self.host_pool = host_pool
        self.write_policy = write_policy
        self.storage_io = storage_io
        self.metrics = metrics or HiCacheMetrics(None)
        self.counters = TierCounters()
        self._pending: list[TreeNode] = []  # nodes waiting for their write-through host copy
        super().__init__(allocator, page_size, enable_events=enable_events)
        self.hash_pages = True  # storage keys; host copies' events
        self.layout = PageLayout(host_pool.num_layers, page_size, host_pool.device_pool.num_kv_heads,
                                 host_pool.device_pool.head_dim, host_pool.dtype)

    # ----- sizes --------------------------------------------------------------------------

    def host_tokens(self) -> int:
        return self.host_pool.used_tokens()

    def tree_host_tokens(self) -> int:
        """Host slots the tree references (== host_tokens() by the invariant)."""
        return sum(len(n.host_value) for n in self._nodes() if n.host_value is not None)

    def _nodes(self):
        stack = [c for root in self.roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    # ----- match: device, then host, then storage -------------------------------------------

    def match_prefix(self, key: list[int], *, record_stats: bool = True,
                     namespace: Optional[CacheNamespace] = None) -> HiMatchResult:
        """The longest prefix in any tier, loaded onto the device: host pages into fresh device slots, storage
        pages (under the prefetch policy) into fresh slots as a new leaf. A load that finds no room or a bad page
        stops the match there; the rest is recomputed."""
        if record_stats:
            self.queried_tokens += len(key)
        root = self._root(namespace, create=False)
        if root is None:
            return HiMatchResult(self._empty(), self.root)
        key = key[: self._aligned(len(key))]
        path, rest = self._walk(root, key)
        started = time.perf_counter()
        host_tokens = self._load_host(path)
        on_device = [n for n in path if n.value is not None]
        last = on_device[-1] if on_device else root
        disk_tokens = 0
        if self.storage_io is not None and rest and namespace is None and len(on_device) == len(path):
            disk_tokens, last = self._load_storage(last, rest)
        if host_tokens or disk_tokens:
            self.metrics.load_back_seconds.observe(time.perf_counter() - started)
        values = self._path_values(last)
        indices = torch.cat(values) if values else self._empty()
        if record_stats:
            self.hit_tokens += int(indices.numel())
        return HiMatchResult(indices, last, host_tokens, disk_tokens)

    def prefetch(self, key: list[int], namespace: Optional[CacheNamespace] = None) -> None:
        """Start the L3 reads for the pages of `key` past what the tree holds (a request just arrived): by the
        time it is scheduled they may have arrived. Changes nothing in the tree."""
        if self.storage_io is None or namespace is not None:
            return
        key = key[: self._aligned(len(key))]
        node, parent_hash = self.root, None
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            matched = self._match_len(child.key, key)
            parent_hash = child.block_hashes[matched // self.page_size - 1]
            node, key = child, key[matched:]
            if matched < len(child.key):
                break
        hashes, prev = [], parent_hash
        for start in range(0, len(key), self.page_size):
            prev = block_hash(prev, key[start:start + self.page_size])
            hashes.append(prev)
        self.storage_io.start_reads(hashes)

    def _walk(self, root: TreeNode, key: list[int]) -> tuple[list[TreeNode], list[int]]:
        """Nodes matching `key` from `root` (splitting the last at the match end) and the unmatched rest."""
        node, path = root, []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            self._touch(child)
            matched = self._match_len(child.key, key)
            partial = matched < len(child.key)
            if partial:
                child = self._split(child, matched)
            path.append(child)
            node, key = child, key[matched:]
            if partial:
                break
        return path, key

    def _path_values(self, node: TreeNode) -> list[torch.Tensor]:
        values = []
        while not node.is_root:
            values.append(node.value)
            node = node.parent
        return values[::-1]

    def _load_host(self, path: list[TreeNode]) -> int:
        """Give the host-only nodes of `path` fresh device slots and copy their KV in; return tokens loaded (stops
        at the first node that finds no room)."""
        host_only = [n for n in path if n.value is None]
        if not host_only:
            return 0
        anchor = host_only[0].parent
        loaded = 0
        for node in host_only:
            node.host_ref += 1
        try:
            for node in host_only:
                slots = self._alloc_device(len(node.key), anchor)
                if slots is None:
                    break
                self.host_pool.load(node.host_value, slots)
                node.value = slots
                self._evictable_size += len(node.key)
                self._emit_stored(node, "device")
                loaded += len(node.key)
                anchor = node
        finally:
            for node in host_only:
                node.host_ref -= 1
        self._count_load("host", loaded)
        return loaded

    def _alloc_device(self, num_tokens: int, keep: TreeNode) -> Optional[torch.Tensor]:
        """Fresh device slots, evicting (demoting) other unlocked nodes; the path to `keep` stays."""
        if self.allocator.available_size() < num_tokens:
            if not keep.is_root:
                self.inc_lock_ref(keep)
            try:
                self.evict(num_tokens - self.allocator.available_size())
            finally:
                if not keep.is_root:
                    self.dec_lock_ref(keep)
        return self.allocator.alloc(num_tokens)

    def _load_storage(self, parent: TreeNode, rest: list[int]) -> tuple[int, TreeNode]:
        """Pages of `rest` that storage holds (consecutive from the first), read under the prefetch policy and
        written into fresh device slots as a new leaf under `parent`; return (tokens, deepest node)."""
        hashes = self._chain_hashes(parent, rest)
        payloads = self.storage_io.read_prefix(hashes)
        rows = []
        for page_hash, payload in zip(hashes, payloads):
            try:
                rows.append(decode_page(self.layout, payload))
            except PageFormatError as e:
                self.counters.corrupt_pages += 1
                logger.warning("HiCache: dropping a bad L3 page (%s); recomputing from there", e)
                self.storage_io.drop(page_hash)
                break
        if not rows:
            return 0, parent
        tokens = len(rows) * self.page_size
        slots = self._alloc_device(tokens, parent)
        if slots is None:
            return 0, parent
        self._write_device(slots, rows)
        self._count_load("disk", tokens)
        leaf = self._add_leaf(parent, rest[:tokens], slots)
        return tokens, leaf

    def _write_device(self, slots: torch.Tensor, pages: list[list[torch.Tensor]]) -> None:
        pool = self.host_pool.device_pool
        dst = slots.to(pool.device)
        for layer in range(pool.num_layers):
            k, v = pool.get_kv_buffer(layer)
            for i, buf in enumerate((k, v)):
                rows = torch.cat([page[2 * layer + i] for page in pages]).to(pool.device)
                buf.view(torch.uint8).index_copy_(0, dst, rows)

    def _count_load(self, tier: str, tokens: int) -> None:
        if tokens:
            self.counters.loaded[tier] += tokens
            self.metrics.moved_bytes(tier, "read", tokens * self.host_pool.bytes_per_token())

    # ----- insert, split, hits ---------------------------------------------------------------

    def insert(self, key: list[int], value: torch.Tensor, namespace: Optional[CacheNamespace] = None) -> int:
        """As RadixCache.insert; a device-evicted node on the path takes the caller's fresh slots (its host copy
        stays), and is not counted in the returned length, which covers only what the device already held."""
        if len(value) != len(key):
            raise ValueError(f"key has {len(key)} tokens but value has {len(value)} slots")
        aligned = self._aligned(len(key))
        key, value = key[:aligned], value[:aligned]
        if not key:
            return 0
        node, present, on_device = self._root(namespace, create=True), 0, True
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            self._touch(child)
            matched = self._match_len(child.key, key)
            if matched < len(child.key):
                child = self._split(child, matched)
            if child.value is None:
                on_device = False
                child.value = value[:matched].clone()
                self._evictable_size += matched
                self._emit_stored(child, "device")
            elif on_device:
                present += matched
            node, key, value = child, key[matched:], value[matched:]
        if key:
            self._add_leaf(node, key, value.clone())
        return present

    def _add_leaf(self, parent: TreeNode, key: list[int], value: torch.Tensor) -> TreeNode:
        leaf = super()._add_leaf(parent, key, value)
        if self.write_policy == "write_through":
            self._pending.append(leaf)
        return leaf

    def _split(self, child: TreeNode, split_len: int) -> TreeNode:
        value = child.value
        if value is None:
            child.value = self._empty()  # the base split slices it; restored below
        upper = super()._split(child, split_len)
        if value is None:
            upper.value = child.value = None
        if child.host_value is not None:
            upper.host_value, child.host_value = child.host_value[:split_len], child.host_value[split_len:]
        upper.hit_count, upper.host_ref = child.hit_count, child.host_ref
        if any(n is child for n in self._pending):
            self._pending.append(upper)
        return upper

    def record_admission(self, node: TreeNode, cached_tokens: int, loaded: dict) -> None:
        """An admitted request reuses `cached_tokens` ending at `node`, `loaded` of them brought back from the host
        and disk tiers by its matches: count hits per tier, and count the hit on the path."""
        host = min(loaded["host"], cached_tokens)
        disk = min(loaded["disk"], cached_tokens - host)
        for tier, tokens in (("device", cached_tokens - host - disk), ("host", host), ("disk", disk)):
            self.counters.hits[tier] += tokens
            if tokens:
                self.metrics.hit_tokens(tier, tokens)
        self.record_hit(node)

    def record_hit(self, node: TreeNode) -> None:
        """An admitted request reuses the path to `node`: write_through_selective copies nodes hit twice."""
        while not node.is_root:
            node.hit_count += 1
            if self.write_policy == "write_through_selective" and node.hit_count >= SELECTIVE_HITS \
                    and node.host_value is None:
                self._pending.append(node)
            node = node.parent

    def _drain_pending(self) -> None:
        """Host copies for pending nodes that are unlocked now (their KV is computed); the rest wait."""
        waiting = []
        for node in self._pending:
            if node.value is None or node.host_value is not None or node.parent is None \
                    or node.parent.children.get(self._child_key(node.key)) is not node:
                continue  # demoted, copied, or gone already
            if node.lock_ref:
                waiting.append(node)
            else:
                self._backup(node)
        self._pending = waiting

    def dec_lock_ref(self, node: TreeNode) -> int:
        moved = super().dec_lock_ref(node)
        if self._pending:
            self._drain_pending()
        return moved

    # ----- copies between tiers ---------------------------------------------------------------

    def _backup(self, node: TreeNode, protect: Optional[TreeNode] = None) -> bool:
        """Give device node `node` a host copy (evicting older host copies for room); False when none fits."""
        tokens = len(node.key)
        if self.host_pool.available_size() < tokens:
            node.host_ref += 1
            try:
                self._evict_host(tokens - self.host_pool.available_size())
            finally:
                node.host_ref -= 1
        host_slots = self.host_pool.alloc(tokens)
        if host_slots is None:
            return False
        self.host_pool.backup(node.value, host_slots)
        node.host_value = host_slots
        self.metrics.moved_bytes("host", "write", tokens * self.host_pool.bytes_per_token())
        self.metrics.host_tokens.set(self.host_pool.used_tokens())
        self._emit_stored(node, "host")
        if self.storage_io is not None and self.write_policy != "write_back":
            self._store(node)
        return True

    def _store(self, node: TreeNode) -> None:
        """Queue the node's pages for L3 (base-model pages only: an adapter's load is this process's)."""
        if self.storage_io is None or node.lora_id or not node.block_hashes:
            return
        rows = self.host_pool.read_rows(node.host_value) if node.host_value is not None else self._device_rows(node)
        parent_hash = node.parent.block_hashes[-1] if node.parent.block_hashes else None
        self.storage_io.write_pages(self.layout, node.block_hashes, parent_hash, node.key, rows)

    def _device_rows(self, node: TreeNode) -> list[torch.Tensor]:
        pool = self.host_pool.device_pool
        src = node.value.to(pool.device)
        rows = []
        for layer in range(pool.num_layers):
            k, v = pool.get_kv_buffer(layer)
            rows += [k.view(torch.uint8).index_select(0, src).cpu(), v.view(torch.uint8).index_select(0, src).cpu()]
        return rows

    # ----- eviction -----------------------------------------------------------------------------

    def evict(self, num_tokens: int, roots: Optional[list[TreeNode]] = None) -> int:
        """Free device slots of unlocked device leaves, least recently used first, demoting each to the host
        (dropping it, to L3 when there is a backend, when no host copy fits); return device tokens freed."""
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access_time, n.id, n) for n in self._device_leaves(roots)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if node.value is None or node.lock_ref:
                continue
            if node.host_value is None and not self._backup(node):
                self._drop_host_subtree(node)
                self._store(node)
                self.allocator.free(node.value)
                freed += len(node.key)
                node.value = None
                self._evictable_size -= len(node.key)
                self._emit_removed(node, "device")
                self._remove_node(node)
            else:
                self.allocator.free(node.value)
                freed += len(node.key)
                node.value = None
                self._evictable_size -= len(node.key)
                self._emit_removed(node, "device")
            parent = node.parent
            if not parent.is_root and parent.lock_ref == 0 and self._is_device_leaf(parent):
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return freed

    @staticmethod
    def _is_device_leaf(node: TreeNode) -> bool:
        return node.value is not None and all(c.value is None for c in node.children.values())

    def _device_leaves(self, roots: Optional[list[TreeNode]]) -> list[TreeNode]:
        leaves, stack = [], list(self.roots.values()) if roots is None else list(roots)
        while stack:
            node = stack.pop()
            stack.extend(c for c in node.children.values() if c.value is not None)
            if not node.is_root and node.lock_ref == 0 and self._is_device_leaf(node):
                leaves.append(node)
        return leaves

    def _evict_host(self, num_tokens: int) -> int:
        """Free host slots, least recently used first: a device node just loses its copy; a host-only leaf is
        written to L3 (when there is a backend) and leaves the tree. Return host tokens freed."""
        heap = [(n.last_access_time, n.id, n) for n in self._nodes() if self._host_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if not self._host_evictable(node):
                continue
            self._store(node)
            freed += self._free_host(node)
            if node.value is None:
                parent = node.parent
                self._remove_node(node)
                if not parent.is_root and self._host_evictable(parent):
                    heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return freed

    @staticmethod
    def _host_evictable(node: TreeNode) -> bool:
        return node.host_value is not None and node.host_ref == 0 and (node.value is not None or not node.children)

    def _free_host(self, node: TreeNode) -> int:
        tokens = len(node.host_value)
        self.host_pool.free(node.host_value)
        node.host_value = None
        self.metrics.host_tokens.set(self.host_pool.used_tokens())
        self._emit_removed(node, "host")
        return tokens

    def _drop_host_subtree(self, node: TreeNode) -> None:
        """Remove `node`'s host-only descendants (to L3 first, when there is a backend)."""
        for child in list(node.children.values()):
            self._drop_host_subtree(child)
            self._store(child)
            self._free_host(child)
            self._remove_node(child)

    def _remove_node(self, node: TreeNode) -> None:
        if node.host_value is not None:
            self._free_host(node)
        del node.parent.children[self._child_key(node.key)]

    def _emit_removed(self, node: TreeNode, tier: str) -> None:
        if self.enable_events:
            self._events.append(BlockRemoved(list(node.block_hashes), tier))

    # ----- whole-cache operations ----------------------------------------------------------------

    def drop_namespace(self, namespace: CacheNamespace) -> int:
        """Free every unlocked node of `namespace` from device and host (no demotion: the adapter is gone)."""
        root = self.roots.get(namespace)
        if root is None or namespace is None:
            return 0
        freed = self._drop_unlocked(root)
        if not root.children:
            del self.roots[namespace]
        return freed

    def _drop_unlocked(self, node: TreeNode) -> int:
        freed = 0
        for child in list(node.children.values()):
            freed += self._drop_unlocked(child)
            if child.lock_ref == 0 and not child.children:
                if child.value is not None:
                    self.allocator.free(child.value)
                    self._evictable_size -= len(child.key)
                    freed += len(child.key)
                    self._emit_removed(child, "device")
                self._remove_node(child)
        return freed

    def flush(self, tier: str) -> None:
        """Empty one tier (device: demote everything unlocked; host: drop every host copy; disk: clear storage) or
        all of them."""
        if tier == "device":
            self.evict(self.evictable_size())
        if tier == "host":
            for root in self.roots.values():
                self._drop_host_copies(root)
        if tier in ("disk", "all") and self.storage_io is not None:
            self.storage_io.clear()
        if tier == "all":
            self.reset()

    def _drop_host_copies(self, node: TreeNode) -> None:
        for child in list(node.children.values()):
            self._drop_host_copies(child)
            if child.host_value is not None and child.host_ref == 0:
                if child.value is None and not child.children:
                    self._remove_node(child)
                elif child.value is not None:
                    self._free_host(child)

    def reset(self) -> None:
        """Free every device and host slot and empty the tree (L3 stays: flush("disk") clears it)."""
        if self._protected_size:
            raise RuntimeError(f"reset with {self._protected_size} locked tokens in the radix cache")
        self.allocator.free_group_begin()
        try:
            for node in self._nodes():
                if node.value is not None:
                    self.allocator.free(node.value)
                if node.host_value is not None:
                    self.host_pool.free(node.host_value)
        finally:
            self.allocator.free_group_end()
        self._pending = []
        self._init_tree()
        self.metrics.host_tokens.set(self.host_pool.used_tokens())
        if self.enable_events:
            self._events.append(AllCleared())

    def tier_report(self) -> dict:
        """Per-tier occupancy and traffic for Engine.memory_report (host_tokens must equal host_tree_tokens)."""
        report = {"host_tokens": self.host_tokens(), "host_tree_tokens": self.tree_host_tokens(),
                  "host_total_tokens": self.host_pool.size, "corrupt_pages": self.counters.corrupt_pages,
                  **{f"loaded_{tier}_tokens": n for tier, n in self.counters.loaded.items()},
                  **{f"hit_{tier}_tokens": n for tier, n in self.counters.hits.items()}}
        if self.storage_io is not None:
            self.storage_io.flush()
            report.update(storage_bytes=self.storage_io.backend.bytes_used(),
                          storage_pages=len(self.storage_io.backend.keys_by_age()),
                          storage_written_pages=self.storage_io.written_pages,
                          storage_skipped_writes=self.storage_io.skipped_writes)
        return report

    def close(self) -> None:
        if self.storage_io is not None:
            self.storage_io.close()

    def take_events(self):
        events = super().take_events()
        if self.storage_io is not None:
            events += self.storage_io.take_events()
        return events
