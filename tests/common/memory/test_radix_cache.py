"""RadixCache: page-aligned match/insert, node splits, lock accounting, LRU eviction, KV events."""

import random

import pytest
import torch

from tandem.common.memory.allocator import PagedTokenToKVPoolAllocator
from tandem.common.memory.chunk_cache import ChunkCache
from tandem.common.memory.radix_cache import (
                                              AllCleared,
                                              BlockRemoved,
                                              BlockStored,
                                              CacheNamespace,
                                              RadixCache,
                                              )
from tandem.common.memory.page_hash import block_hash, page_hashes


def make(page_size=1, size=256, **kw):
    alloc = PagedTokenToKVPoolAllocator(size=size, page_size=page_size)
    return alloc, RadixCache(alloc, page_size=page_size, **kw)


def cache_seq(alloc, cache, key):
    """Like a finished request: match, compute the rest, insert, free duplicates and the tail."""
    match = cache.match_prefix(key, record_stats=False)
    prefix = len(match.device_indices)
    last_loc = int(match.device_indices[-1]) if prefix else -1
    new = alloc.alloc_extend([prefix], [len(key)], [last_loc])
    assert new is not None
    value = torch.cat([match.device_indices, new])
    present = cache.insert(key, value)
    assert present >= prefix
    alloc.free(value[prefix:present])
    aligned = len(key) - len(key) % cache.page_size
    if aligned < len(key):
        alloc.free(value[aligned:])
    return value[:aligned]


def check_sizes(cache, evictable, protected):
    assert cache.evictable_size() == evictable
    assert cache.protected_size() == protected
    assert cache.total_size() == evictable + protected


def test_match_on_empty_cache():
    _, cache = make()
    m = cache.match_prefix([1, 2, 3])
    assert m.device_indices.numel() == 0 and m.device_indices.dtype == torch.int64
    assert m.last_node is cache.root
    check_sizes(cache, 0, 0)


def test_insert_then_exact_and_partial_match():
    alloc, cache = make()
    value = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], value) == 0
    check_sizes(cache, 5, 0)
    assert cache.match_prefix([1, 2, 3, 4, 5]).device_indices.tolist() == value.tolist()
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7]).device_indices.tolist() == value.tolist()
    m = cache.match_prefix([1, 2, 9])
    assert m.device_indices.tolist() == value[:2].tolist()
    assert m.last_node.key == [1, 2]  # split so last_node covers exactly the match
    assert cache.match_prefix([9, 1]).device_indices.numel() == 0
    check_sizes(cache, 5, 0)


def test_split_in_the_middle_page_size_one():
    alloc, cache = make()
    a = alloc.alloc(6)
    cache.insert([1, 2, 3, 4, 5, 6], a)
    b = alloc.alloc(6)
    assert cache.insert([1, 2, 3, 7, 8, 9], b) == 3
    alloc.free(b[:3])  # duplicates of the cached prefix
    check_sizes(cache, 9, 0)
    (mid,) = cache.root.children.values()
    assert mid.key == [1, 2, 3] and len(mid.children) == 2
    assert cache.match_prefix([1, 2, 3, 7, 8, 9]).device_indices.tolist() == a[:3].tolist() + b[3:].tolist()
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).device_indices.tolist() == a.tolist()


def test_page_alignment_never_matches_partial_pages():
    alloc, cache = make(page_size=4)
    key = list(range(100, 110))  # 10 tokens: two whole pages
    value = alloc.alloc(10)
    assert cache.insert(key, value) == 0
    check_sizes(cache, 8, 0)
    alloc.free(value[8:])
    assert cache.match_prefix(key).device_indices.tolist() == value[:8].tolist()
    assert cache.match_prefix(key[:7]).device_indices.tolist() == value[:4].tolist()
    # Diverging inside the second page: only the first page matches, split at 4.
    m = cache.match_prefix(key[:6] + [0, 0])
    assert m.device_indices.tolist() == value[:4].tolist() and m.last_node.key == key[:4]
    assert cache.match_prefix(key[:3]).device_indices.numel() == 0
    # Diverging inside the first page: nothing.
    assert cache.match_prefix([100, 101, 0, 0, 104]).device_indices.numel() == 0


def test_page_aligned_insert_returns_present_length():
    alloc, cache = make(page_size=4)
    a = alloc.alloc(8)
    cache.insert(list(range(8)), a)
    b = alloc.alloc(12)
    key = list(range(6)) + [50] * 6
    assert cache.insert(key, b) == 4  # second page diverges at token 6
    alloc.free(b[:4])
    check_sizes(cache, 16, 0)
    assert cache.match_prefix(key).device_indices.tolist() == a[:4].tolist() + b[4:].tolist()
    assert cache.insert(list(range(8)), a) == 8  # fully present: nothing taken
    check_sizes(cache, 16, 0)


def test_lock_protects_from_eviction_and_sizes_track():
    alloc, cache = make()
    cache_seq(alloc, cache, [1, 2, 3, 4])
    cache_seq(alloc, cache, [1, 2, 5, 6])
    check_sizes(cache, 6, 0)
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    assert cache.inc_lock_ref(node) == 4
    check_sizes(cache, 2, 4)
    node2 = cache.match_prefix([1, 2, 5, 6]).last_node
    assert cache.inc_lock_ref(node2) == 2  # [1, 2] already protected
    check_sizes(cache, 0, 6)
    assert cache.evict(100) == 0
    assert cache.dec_lock_ref(node) == 2
    check_sizes(cache, 2, 4)
    assert cache.evict(100) == 2
    check_sizes(cache, 0, 4)
    assert cache.dec_lock_ref(node2) == 4
    check_sizes(cache, 4, 0)
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node2)


def test_split_of_locked_node_keeps_lock_accounting():
    alloc, cache = make()
    cache.insert([1, 2, 3, 4], alloc.alloc(4))
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(node)
    check_sizes(cache, 0, 4)
    cache.match_prefix([1, 2, 9])  # splits the locked node
    check_sizes(cache, 0, 4)
    b = alloc.alloc(3)
    assert cache.insert([1, 2, 7], b) == 2
    alloc.free(b[:2])
    check_sizes(cache, 1, 4)
    cache.dec_lock_ref(node)
    check_sizes(cache, 5, 0)
    assert cache.evict(5) == 5
    assert alloc.available_size() == alloc.size


def test_eviction_is_lru_over_leaves():
    alloc, cache = make()
    cache_seq(alloc, cache, [1, 2, 3])
    cache_seq(alloc, cache, [1, 2, 4])
    check_sizes(cache, 4, 0)
    cache_seq(alloc, cache, [5, 6])
    cache.match_prefix([1, 2, 3])  # [1,2,3] newest, then [5,6], [1,2,4] oldest
    assert cache.evict(1) == 1
    assert cache.match_prefix([1, 2, 4]).device_indices.numel() == 2
    assert cache.evict(1) == 2  # [5, 6] is the oldest leaf now, evicted whole
    assert cache.match_prefix([5, 6]).device_indices.numel() == 0
    # [1,2] only becomes evictable once its child [3] is gone.
    assert cache.evict(1) == 1
    check_sizes(cache, 2, 0)
    assert cache.evict(10) == 2
    check_sizes(cache, 0, 0)
    assert alloc.available_size() == alloc.size


def test_reset_frees_everything_and_refuses_while_locked():
    alloc, cache = make(page_size=2)
    cache_seq(alloc, cache, [1, 2, 3, 4, 5])
    cache_seq(alloc, cache, [1, 2, 7, 8])
    assert alloc.available_size() + cache.total_size() == alloc.size
    node = cache.match_prefix([1, 2, 7, 8]).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset()
    check_sizes(cache, 0, 0)
    assert alloc.available_size() == alloc.size
    assert cache.match_prefix([1, 2]).device_indices.numel() == 0


def test_hit_counters():
    alloc, cache = make()
    cache.insert([1, 2, 3, 4], alloc.alloc(4))
    cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    cache.match_prefix([1, 2, 9, 9])
    cache.match_prefix([1, 2, 3], record_stats=False)
    assert cache.hit_tokens == 6 and cache.queried_tokens == 12
    assert cache.hit_rate() == pytest.approx(0.5)


def test_events_chain_hashes_and_drain():
    alloc, cache = make(page_size=2, enable_events=True)
    a = cache_seq(alloc, cache, [1, 2, 3, 4, 5])  # pages [1,2] [3,4]; 5 is an unaligned tail
    cache_seq(alloc, cache, [1, 2, 3, 4, 6, 7])
    cache_seq(alloc, cache, [1, 2, 8, 9])  # splits [1,2 | 3,4]
    events = cache.take_events()
    assert [type(e) for e in events] == [BlockStored] * 3
    first, second, third = events
    h12 = block_hash(None, [1, 2])
    h34 = block_hash(h12, [3, 4])
    assert first == BlockStored([h12, h34], None, [1, 2, 3, 4], 2)
    assert second == BlockStored([block_hash(h34, [6, 7])], h34, [6, 7], 2)
    assert third == BlockStored([block_hash(h12, [8, 9])], h12, [8, 9], 2)
    assert cache.take_events() == []
    assert isinstance(h12, int) and -(2**63) <= h12 < 2**63
    assert a.numel() == 4
    # Evict everything: every stored block is removed exactly once.
    cache.evict(100)
    removed = [h for e in cache.take_events() for h in e.block_hashes]
    stored = {h12, h34, second.block_hashes[0], third.block_hashes[0]}
    assert sorted(removed) == sorted(stored)
    cache_seq(alloc, cache, [1, 2])
    cache.reset()
    events = cache.take_events()
    assert isinstance(events[0], BlockStored) and events[-1] == AllCleared()
    assert not any(isinstance(e, BlockRemoved) for e in events)


def test_events_off_by_default():
    alloc, cache = make()
    cache_seq(alloc, cache, [1, 2, 3])
    cache.evict(3)
    assert cache.take_events() == []


def test_disabled_radix_cache_keeps_nothing():
    alloc, cache = make(disable=True)
    v = alloc.alloc(3)
    assert cache.insert([1, 2, 3], v) == 0
    assert cache.match_prefix([1, 2, 3]).device_indices.numel() == 0
    assert cache.total_size() == 0 and cache.evict(5) == 0


def test_chunk_cache_has_the_radix_cache_interface():
    alloc = PagedTokenToKVPoolAllocator(size=16, page_size=4)
    chunk = ChunkCache(alloc, page_size=4)
    public = {n for n in dir(RadixCache) if not n.startswith("_")}
    assert public <= set(dir(chunk))
    m = chunk.match_prefix([1, 2, 3, 4, 5])
    assert m.device_indices.numel() == 0 and m.device_indices.dtype == torch.int64
    assert chunk.inc_lock_ref(m.last_node) == 0 and chunk.dec_lock_ref(m.last_node) == 0
    v = alloc.alloc(8)
    assert chunk.insert(list(range(8)), v) == 0
    assert chunk.evict(8) == 0 and alloc.available_size() == 8
    assert chunk.total_size() == chunk.evictable_size() == chunk.protected_size() == 0
    assert chunk.hit_tokens == chunk.queried_tokens == 0 and chunk.hit_rate() == 0.0
    assert chunk.take_events() == []
    chunk.reset()


def _tree_slots(cache):
    slots, stack = [], list(cache.root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        slots.extend(node.value.tolist())
        assert len(node.key) == len(node.value) and len(node.key) % cache.page_size == 0
        assert len(node.key) > 0
    return slots


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_randomized_invariants(page_size):
    rng = random.Random(1234 + page_size)
    alloc, cache = make(page_size=page_size, size=128 * page_size, enable_events=True)
    locked = []  # (node, slots held outside the tree by the "request")
    live_blocks: set[int] = set()
    for step in range(400):
        op = rng.random()
        if op < 0.6:
            key = [rng.randrange(4) for _ in range(rng.randrange(1, 24))]
            match = cache.match_prefix(key)
            need = len(key) - len(match.device_indices)
            if alloc.available_size() < need + page_size:
                cache.evict(need + page_size)
            if alloc.available_size() < need + page_size:
                continue
            cache_seq(alloc, cache, key)
        elif op < 0.75:
            key = [rng.randrange(4) for _ in range(rng.randrange(1, 24))]
            node = cache.match_prefix(key).last_node
            cache.inc_lock_ref(node)
            locked.append(node)
        elif op < 0.9 and locked:
            cache.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        else:
            cache.evict(rng.randrange(1, 20))
        for event in cache.take_events():
            if isinstance(event, BlockStored):
                assert event.parent_block_hash is None or event.parent_block_hash in live_blocks
                assert not live_blocks & set(event.block_hashes)
                live_blocks |= set(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= live_blocks
                live_blocks -= set(event.block_hashes)
        tree_slots = _tree_slots(cache)
        assert len(tree_slots) == len(set(tree_slots)), "slot owned twice"
        assert len(tree_slots) == cache.total_size()
        assert alloc.available_size() + cache.total_size() == alloc.size
        free_slots = {p * page_size + o for p in alloc.free_pages.tolist() for o in range(page_size)}
        assert not free_slots & set(tree_slots)
        assert len(live_blocks) * page_size == cache.total_size()
    while locked:
        cache.dec_lock_ref(locked.pop())
    assert cache.protected_size() == 0
    cache.evict(10**9)
    assert cache.total_size() == 0 and alloc.available_size() == alloc.size


def test_evict_frees_parent_once_its_children_are_gone():
    alloc, cache = make(page_size=2)
    cache_seq(alloc, cache, [1, 2, 3, 4])
    cache_seq(alloc, cache, [1, 2, 5, 6])  # [1,2] -> {[3,4], [5,6]}
    cache.match_prefix([1, 2, 5, 6])
    assert cache.evict(2) == 2  # only the older leaf [3,4]
    assert cache.match_prefix([1, 2, 5, 6], record_stats=False).device_indices.numel() == 4
    assert cache.evict(3) == 4  # [5,6], then its parent [1,2] became a leaf
    assert cache.total_size() == 0 and alloc.available_size() == alloc.size


def test_namespaces_isolate_adapters_and_drop_frees_them():
    """A prefix cached under adapter A (one load of it) is matched only under A: never by the base model, another
    adapter or a reload of A; its events name A and hash as the router does; dropping A frees its unlocked slots
    now and its locked ones once unlocked."""
    alloc, cache = make(page_size=2, enable_events=True)
    a, b, a_reloaded = CacheNamespace("A", 1), CacheNamespace("B", 2), CacheNamespace("A", 3)
    key = [1, 2, 3, 4, 5]
    cache.insert(key[:4], alloc.alloc(4), namespace=a)
    assert cache.insert(key[:4], alloc.alloc(4)) == 0  # the base's copy is its own
    assert len(cache.match_prefix(key, namespace=a).device_indices) == 4
    for other in (b, a_reloaded):
        assert cache.match_prefix(key, namespace=other).device_indices.numel() == 0
    stored = [e for e in cache.take_events() if isinstance(e, BlockStored)]
    assert [e.lora_id for e in stored] == ["A", ""]
    assert stored[0].block_hashes == page_hashes(key, 2, "A") != stored[1].block_hashes == page_hashes(key, 2)
    slots = alloc.alloc(4)
    alloc.free(slots[:cache.insert([1, 2, 9, 9], slots, namespace=a)])  # [1, 2] was A's already
    locked = cache.match_prefix([1, 2, 9, 9], namespace=a).last_node
    cache.inc_lock_ref(locked)
    assert cache.drop_namespace(a) == 2  # [3, 4]; [1, 2] and [9, 9] are locked
    assert cache.match_prefix(key, namespace=a).device_indices.numel() == 2
    cache.dec_lock_ref(locked)
    assert cache.drop_namespace(a) == 4 and a not in cache.roots
    assert len(cache.match_prefix(key).device_indices) == 4  # the base model's prefix is untouched
    removed = [h for e in cache.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(page_hashes(key, 2, "A") + page_hashes([1, 2, 9, 9], 2, "A")[1:])
    check_sizes(cache, 4, 0)
    cache.insert(key[:4], alloc.alloc(4), namespace=b)
    cache.reset()
    assert alloc.available_size() == alloc.size and list(cache.roots) == [None]
