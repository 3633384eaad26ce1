"""Page-aligned prefix tree over token ids whose values are KV slots: prefix reuse, lock refs, LRU eviction."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from tandem.common.memory.cache_events import AllCleared, BlockRemoved, BlockStored, KVCacheEvent
from tandem.common.memory.page_hash import block_hash, namespace_seed

if TYPE_CHECKING:
    from tandem.common.memory.allocator import PagedTokenToKVPoolAllocator


@dataclass(frozen=True)
class CacheNamespace:
    """KV computed under one LoRA adapter, as loaded once: a reload of the same id (maybe other weights) is a new
    namespace, so nothing cached under the old load can be matched by the new one."""

    lora_id: str
    generation: int


# ----- the tree ---------------------------------------------------------------------------


class TreeNode:
    _ids = itertools.count()

    def __init__(self, parent: TreeNode | None = None, lora_id: str = ""):
        self.id = next(TreeNode._ids)
        self.parent = parent
        self.lora_id = parent.lora_id if parent is not None else lora_id  # the namespace's adapter, for events
        self.children: dict = {}
        self.key: list[int] = []
        self.value: torch.Tensor | None = None
        self.lock_ref = 0
        self.last_access_time = 0
        self.block_hashes: list[int] = []  # one per page, only when events are enabled (or HiCache's L3 keys them)
        # HiCache (hiradix_cache.py): the host copy's slots, admissions that reused the node, pins while loading.
        self.host_value: torch.Tensor | None = None
        self.hit_count = 0
        self.host_ref = 0

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


@dataclass
class MatchResult:
    device_indices: torch.Tensor  # int64 KV slots of the matched prefix
    last_node: TreeNode  # deepest matched node; lock it while the slots are in use


class RadixCache:
    """Prefix cache keyed by token ids, only ever holding whole pages.

    Namespaces: the base model's prefixes hang under ``root``; each LoRA adapter's (a ``CacheNamespace``) under a
    root of its own, so a prefix is only ever matched by requests of the namespace that computed it.

    Ownership: slots inside the tree belong to the tree; they go back to the
    allocator only through ``evict`` or ``reset``. Nodes on a locked path
    (``inc_lock_ref``) are never evicted.
    """

    def __init__(
        self,
        allocator: PagedTokenToKVPoolAllocator,
        page_size: int,
        disable: bool = False,
        enable_events: bool = False,
    ):
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        self.enable_events = enable_events
        self.hash_pages = enable_events  # block_hashes on every node (events; a subclass's storage keys)
        self.device = allocator.device
        self._clock = itertools.count(1)  # logical time: deterministic LRU order
        self._events: list[KVCacheEvent] = []
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = self._new_root("")
        self.roots: dict[Optional[CacheNamespace], TreeNode] = {None: self.root}
        self._evictable_size = 0
        self._protected_size = 0
        self.hit_tokens = 0
        self.queried_tokens = 0

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _new_root(self, lora_id: str) -> TreeNode:
        root = TreeNode(lora_id=lora_id)
        root.value = self._empty()
        root.lock_ref = 1  # a root is never evicted
        return root

    def _root(self, namespace: Optional[CacheNamespace], create: bool) -> Optional[TreeNode]:
        root = self.roots.get(namespace)
        if root is None and create:
            root = self.roots[namespace] = self._new_root(namespace.lora_id)
        return root

    # ----- sizes and counters ----------------------------------------------------------

    def evictable_size(self) -> int:
        """Cached tokens on no locked path."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Cached tokens on some locked path."""
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    # ----- key helpers -----------------------------------------------------------------

    def _child_key(self, key: list[int]):
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _match_len(self, node_key: list[int], key: list[int]) -> int:
        """Length of the common page-aligned prefix of two keys."""
        n = min(len(node_key), len(key))
        if node_key[:n] == key[:n]:
            return self._aligned(n)
        i = 0
        while node_key[i] == key[i]:
            i += 1
        return self._aligned(i)

    def _touch(self, node: TreeNode) -> None:
        node.last_access_time = next(self._clock)

    # ----- match / insert --------------------------------------------------------------

    def match_prefix(self, key: list[int], *, record_stats: bool = True,
                     namespace: Optional[CacheNamespace] = None) -> MatchResult:
        """Longest cached page-aligned prefix of ``key`` within ``namespace`` (None: the base model's).

        Splits a node when the match ends inside it, so ``last_node`` covers exactly
        the match. Counts ``len(key)`` queried tokens and the matched tokens as hits
        unless ``record_stats`` is False (use that when re-matching the same request).
        """
        if record_stats:
            self.queried_tokens += len(key)
        root = self._root(namespace, create=False)
        if self.disable or root is None:
            return MatchResult(self._empty(), root or self.root)
        key = key[: self._aligned(len(key))]
        node, values = root, []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            self._touch(child)
            matched = self._match_len(child.key, key)
            if matched < len(child.key):
                node = self._split(child, matched)
                values.append(node.value)
                break
            values.append(child.value)
            node, key = child, key[matched:]
        indices = torch.cat(values) if values else self._empty()
        if record_stats:
            self.hit_tokens += int(indices.numel())
        return MatchResult(indices, node)

    def insert(self, key: list[int], value: torch.Tensor, namespace: Optional[CacheNamespace] = None) -> int:
        """Cache ``value`` (the KV slots of ``key``) in ``namespace`` and return n: it already held ``key[:n]``.

        Only the page-aligned part of ``key`` is taken; the tree takes ownership of
        ``value[n:aligned_len]``. It does not take ``value[:n]``: the caller must free
        those of its slots that are not the tree's own (the slots it got from an
        earlier ``match_prefix`` are the tree's; slots it computed again are
        duplicates). The unaligned tail stays the caller's.
        """
        if self.disable:
            return 0
        if len(value) != len(key):
            raise ValueError(f"key has {len(key)} tokens but value has {len(value)} slots")
        aligned = self._aligned(len(key))
        key, value = key[:aligned], value[:aligned]
        if not key:
            return 0
        node, present = self._root(namespace, create=True), 0
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            self._touch(child)
            matched = self._match_len(child.key, key)
            if matched < len(child.key):
                child = self._split(child, matched)
            node, present = child, present + matched
            key, value = key[matched:], value[matched:]
        if key:
            self._add_leaf(node, key, value.clone())
        return present

    def _add_leaf(self, parent: TreeNode, key: list[int], value: torch.Tensor) -> TreeNode:
        leaf = TreeNode(parent)
        leaf.key, leaf.value = key, value
        self._touch(leaf)
        parent.children[self._child_key(key)] = leaf
        self._evictable_size += len(key)
        if self.hash_pages:
            # An adapter's first page chains from its namespace seed, so its hashes never equal the base's.
            leaf.block_hashes = self._chain_hashes(parent, key)
        self._emit_stored(leaf, "device")
        return leaf

    def _chain_hashes(self, parent: TreeNode, key: list[int]) -> list[int]:
        """Page hashes of `key`'s full pages placed under `parent`, chained from its last page."""
        hashes, prev = [], parent.block_hashes[-1] if parent.block_hashes else namespace_seed(parent.lora_id)
        for start in range(0, len(key) - len(key) % self.page_size, self.page_size):
            prev = block_hash(prev, key[start : start + self.page_size])
            hashes.append(prev)
        return hashes

    def _emit_stored(self, node: TreeNode, tier: str) -> None:
        if self.enable_events:
            parent_hash = node.parent.block_hashes[-1] if node.parent.block_hashes else None
            self._events.append(BlockStored(list(node.block_hashes), parent_hash, list(node.key), self.page_size,
                                            node.lora_id, tier))

    def _split(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut ``child`` at ``split_len`` (page-aligned); return the new upper node."""
        upper = TreeNode(child.parent)
        upper.key, upper.value = child.key[:split_len], child.value[:split_len]
        upper.lock_ref = child.lock_ref  # every lock through child passes through upper
        upper.last_access_time = child.last_access_time
        pages = split_len // self.page_size
        upper.block_hashes, child.block_hashes = child.block_hashes[:pages], child.block_hashes[pages:]
        child.parent.children[self._child_key(upper.key)] = upper
        child.key, child.value = child.key[split_len:], child.value[split_len:]
        child.parent = upper
        upper.children[self._child_key(child.key)] = child
        return upper

    # ----- locking ---------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock the path root→node; return the tokens that moved from evictable to protected."""
        moved = 0
        while not node.is_root:
            if node.lock_ref == 0:
                moved += len(node.key)
            node.lock_ref += 1
            node = node.parent
        self._evictable_size -= moved
        self._protected_size += moved
        return moved

    def unlocked_tokens_on_path(self, node: TreeNode) -> int:
        """The cached tokens ``inc_lock_ref(node)`` would move from evictable to protected (nothing is locked)."""
        tokens = 0
        while not node.is_root:
            if node.lock_ref == 0:
                tokens += len(node.key)
            node = node.parent
        return tokens

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one ``inc_lock_ref(node)``; return the tokens that became evictable again."""
        moved = 0
        while not node.is_root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref on unlocked {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                moved += len(node.key)
            node = node.parent
        self._evictable_size += moved
        self._protected_size -= moved
        return moved

    # ----- eviction --------------------------------------------------------------------

    def _evictable_leaves(self, roots: Optional[list[TreeNode]] = None) -> list[TreeNode]:
        leaves, stack = [], list(self.roots.values()) if roots is None else roots
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif not node.is_root and node.lock_ref == 0:
                leaves.append(node)
        return leaves

    def evict(self, num_tokens: int, roots: Optional[list[TreeNode]] = None) -> int:
        """Free least recently used unlocked leaves (under ``roots``; default all) until ``num_tokens`` are freed;
        return tokens freed."""
        if self.disable or num_tokens <= 0:
            return 0
        heap = [(leaf.last_access_time, leaf.id, leaf) for leaf in self._evictable_leaves(roots)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.free(leaf.value)
            freed += len(leaf.key)
            self._remove_leaf(leaf)
            parent = leaf.parent
            if not parent.is_root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return freed

    def _remove_leaf(self, leaf: TreeNode) -> None:
        del leaf.parent.children[self._child_key(leaf.key)]
        self._evictable_size -= len(leaf.key)
        if self.enable_events:
            self._events.append(BlockRemoved(list(leaf.block_hashes)))

    # ----- whole-cache operations ------------------------------------------------------

    def drop_namespace(self, namespace: CacheNamespace) -> int:
        """Free every unlocked prefix of ``namespace`` (its adapter was unloaded); return tokens freed.

        Prefixes still locked by running requests stay until those requests end; the caller drops the namespace
        again then. The namespace's root goes once it holds nothing.
        """
        root = self.roots.get(namespace)
        if root is None or namespace is None:
            return 0
        freed = self.evict(self.total_size(), roots=[root])
        if not root.children:
            del self.roots[namespace]
        return freed

    def reset(self) -> None:
        """Free every cached slot back to the allocator and empty the tree.

        Refuses while any path is locked: those slots are still in use by requests.
        """
        if self._protected_size:
            raise RuntimeError(f"reset with {self._protected_size} locked tokens in the radix cache")
        self.allocator.free_group_begin()
        try:
            stack = [child for root in self.roots.values() for child in root.children.values()]
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                self.allocator.free(node.value)
        finally:
            self.allocator.free_group_end()
        self._init_tree()
        if self.enable_events:
            self._events.append(AllCleared())

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the recorded KV events, oldest first."""
        events, self._events = self._events, []
        return events

    def pretty_print(self) -> str:
        """Indented dump of the tree (debugging); also printed."""
        lines: list[str] = []

        def walk(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                head = child.key[:8]
                more = "..." if len(child.key) > 8 else ""
                lines.append(
                    f"{'  ' * depth}{head}{more} len={len(child.key)} "
                    f"lock={child.lock_ref} t={child.last_access_time}"
                )
                walk(child, depth + 1)

        for namespace, root in self.roots.items():
            if namespace is not None:
                lines.append(f"[{namespace.lora_id}#{namespace.generation}]")
            walk(root, int(namespace is not None))
        lines.append(f"#tokens: {self.total_size()} (evictable {self._evictable_size}, protected {self._protected_size})")
        text = "\n".join(lines)
        print(text)
        return text
