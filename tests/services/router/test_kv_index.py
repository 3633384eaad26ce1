"""The router computes page hashes exactly as the worker's RadixCache does, and tracks them from KV events."""

from __future__ import annotations

from smg_grpc_proto.generated import common_pb2

from tandem.common.memory.page_hash import block_hash, page_hashes
from tandem.services.router.kv_index import DEVICE, DISK, HOST, KvBlockIndex


def test_page_hashes_match_the_radix_cache_events():
    from tandem.common.memory.allocator import PagedTokenToKVPoolAllocator
    from tandem.common.memory.radix_cache import RadixCache

    alloc = PagedTokenToKVPoolAllocator(size=64, page_size=4)
    cache = RadixCache(alloc, page_size=4, enable_events=True)
    prompt = list(range(100, 114))  # 3 full pages and an unaligned tail
    cache.insert(prompt, alloc.alloc(len(prompt)))
    stored = [h for event in cache.take_events() for h in event.block_hashes]
    assert stored == page_hashes(prompt, 4) and len(stored) == 3


def test_page_hashes_chain_full_pages_only():
    ids = list(range(10))
    hashes = page_hashes(ids, 4)
    assert len(hashes) == 2
    assert hashes[1] == block_hash(block_hash(None, [0, 1, 2, 3]), [4, 5, 6, 7])


def _stored(seq: int, hashes: list[int], tier: int = common_pb2.KV_CACHE_TIER_UNSPECIFIED) -> common_pb2.KvEventBatch:
    batch = common_pb2.KvEventBatch(sequence_number=seq)
    event = batch.events.add(event_id=seq)
    event.stored.tier = tier
    for h in hashes:
        event.stored.blocks.add(block_hash=h, block_size=4)
    return batch


def test_index_applies_stored_removed_and_cleared_events():
    index = KvBlockIndex()
    hashes = page_hashes(list(range(12)), 4)
    index.apply(_stored(1, hashes))
    assert index.page_size == 4 and index.cached_pages(hashes) == 3
    removed = common_pb2.KvEventBatch(sequence_number=2)
    removed.events.add(event_id=2).removed.block_hashes.extend([hashes[1]])
    index.apply(removed)
    assert index.cached_pages(hashes) == 1  # the chain breaks at the removed page
    cleared = common_pb2.KvEventBatch(sequence_number=3)
    cleared.events.add(event_id=3).cleared.SetInParent()
    index.apply(cleared)
    assert index.cached_pages(hashes) == 0 and index.last_sequence == 3


def test_index_keys_prefixes_per_adapter():
    """A worker's blocks cached under adapter A count for A's requests only, not the base model's or B's."""
    from tandem.common.memory.allocator import PagedTokenToKVPoolAllocator
    from tandem.common.memory.radix_cache import CacheNamespace, RadixCache
    from tandem.common.rpc.kv_events import event_to_proto
    from tandem.services.router.policies import RouteRequest

    alloc = PagedTokenToKVPoolAllocator(size=64, page_size=4)
    cache = RadixCache(alloc, page_size=4, enable_events=True)
    prompt = list(range(100, 112))
    cache.insert(prompt, alloc.alloc(len(prompt)), namespace=CacheNamespace("A", 1))
    batch = common_pb2.KvEventBatch(sequence_number=1, events=[event_to_proto(e, i)
                                                                for i, e in enumerate(cache.take_events(), 1)])
    assert batch.events[0].stored.lora_name == "A"
    index = KvBlockIndex()
    index.apply(batch)
    assert index.cached_pages(RouteRequest(prompt, "A").hashes(4)) == 3
    assert index.cached_pages(RouteRequest(prompt).hashes(4)) == 0
    assert index.cached_pages(RouteRequest(prompt, "B").hashes(4)) == 0


def _removed(seq: int, hashes: list[int], tier: int) -> common_pb2.KvEventBatch:
    batch = common_pb2.KvEventBatch(sequence_number=seq)
    event = batch.events.add(event_id=seq)
    event.removed.block_hashes.extend(hashes)
    event.removed.tier = tier
    return batch


def test_index_tracks_each_blocks_tiers_from_stored_and_removed_events():
    """A page demoted device -> host -> disk, as the engine reports it: stored in the lower tier, then removed
    from the higher one. The page stays matched throughout; its weight follows its fastest copy."""
    index = KvBlockIndex()
    hashes = page_hashes(list(range(8)), 4)
    index.apply(_stored(1, hashes, DEVICE))
    assert index.weighted_pages(hashes) == 2.0
    index.apply(_stored(2, hashes, HOST))
    assert index.blocks[hashes[0]] == {DEVICE, HOST} and index.weighted_pages(hashes) == 2.0
    index.apply(_removed(3, hashes, DEVICE))
    assert index.cached_pages(hashes) == 2 and index.weighted_pages(hashes) == 1.6
    index.apply(_stored(4, hashes[:1], DISK))
    index.apply(_removed(5, hashes[:1], HOST))
    assert index.blocks[hashes[0]] == {DISK} and index.weighted_pages(hashes) == 0.3 + 0.8
    index.apply(_removed(6, hashes[:1], DISK))
    assert hashes[0] not in index.blocks and index.cached_pages(hashes) == 0 and index.weighted_pages(hashes) == 0


def test_index_reads_an_unset_tier_as_the_device_and_removing_another_tier_keeps_the_device_copy():
    """Workers from before tiers send no tier: their events are about the device pool."""
    index = KvBlockIndex()
    hashes = page_hashes(list(range(8)), 4)
    index.apply(_stored(1, hashes))
    assert index.blocks[hashes[1]] == {DEVICE}
    index.apply(_removed(2, hashes, DISK))  # no disk copy existed: the device copy stays
    assert index.weighted_pages(hashes) == 2.0
    index.apply(_removed(3, hashes, common_pb2.KV_CACHE_TIER_UNSPECIFIED))
    assert index.blocks == {}
