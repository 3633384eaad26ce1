"""HiRadixCache: demotion to the host pool, load-back, L3 pages, write policies, and the tier invariants after random
workloads — every matched slot holds the KV its prefix would compute."""

import concurrent.futures
import random
import zlib

import pytest
import torch

from tandem.common.memory.allocator import PagedTokenToKVPoolAllocator
from tandem.common.memory.cache_events import BlockRemoved, BlockStored
from tandem.common.memory.hicache_io import StorageIO
from tandem.common.memory.hicache_storage import FileStorage
from tandem.common.memory.hiradix_cache import HiRadixCache
from tandem.common.memory.host_pool import HostKVPool
from tandem.common.memory.kv_pool import MHATokenToKVPool

PAGE = 4


def token_kv(key: list[int], position: int) -> float:
    """The 'KV' a token computes: a function of its whole prefix, so a slot holding another prefix's KV shows."""
    return float(zlib.crc32(str(key[: position + 1]).encode()) % 100003)


class Harness:
    """A device pool, a host pool and a HiRadixCache, driven like a scheduler drives KVCacheOps."""

    def __init__(self, policy="write_through", device_tokens=32, host_tokens=64, storage_dir=None,
                 prefetch="wait_complete", max_bytes=1 << 30, events=False):
        self.pool = MHATokenToKVPool(device_tokens, PAGE, torch.float32, 2, 1, 2, huge_pages=False)
        self.alloc = PagedTokenToKVPoolAllocator(device_tokens, PAGE)
        self.host = HostKVPool(self.pool, host_tokens)
        self.io = None
        if storage_dir is not None:
            self.io = StorageIO(FileStorage(str(storage_dir)), max_bytes, b"model", prefetch, 1.0,
                                emit_events=events)
        self.cache = HiRadixCache(self.alloc, PAGE, self.host, policy, self.io, enable_events=events)

    def write(self, slots: torch.Tensor, key: list[int], start: int) -> None:
        values = torch.tensor([token_kv(key, start + i) for i in range(len(slots))])
        for layer in range(self.pool.num_layers):
            k, v = self.pool.get_kv_buffer(layer)
            k[slots] = (values + layer)[:, None, None].expand(-1, 1, 2)
            v[slots] = (-values - layer)[:, None, None].expand(-1, 1, 2)

    def check_slots(self, slots: torch.Tensor, key: list[int]) -> None:
        expected = torch.tensor([token_kv(key, i) for i in range(len(slots))])
        for layer in range(self.pool.num_layers):
            k, v = self.pool.get_kv_buffer(layer)
            assert torch.equal(k[slots][:, 0, 0], expected + layer), f"layer {layer} K differs from its prefix's"
            assert torch.equal(v[slots][:, 0, 1], -expected - layer)

    def request(self, key: list[int]) -> int:
        """Match (loading back), compute the rest, insert, finish; return the matched length."""
        match = self.cache.match_prefix(key, record_stats=False)
        prefix = len(match.device_indices)
        self.check_slots(match.device_indices, key)
        self.cache.inc_lock_ref(match.last_node)
        need = len(key) - prefix
        if self.alloc.available_size() < need + PAGE:
            self.cache.evict(need + PAGE - self.alloc.available_size())
        last = int(match.device_indices[-1]) if prefix else -1
        new = self.alloc.alloc_extend([prefix], [len(key)], [last])
        assert new is not None
        self.write(new, key, prefix)
        value = torch.cat([match.device_indices, new])
        present = self.cache.insert(key, value)
        assert present >= prefix
        self.alloc.free(value[prefix:present])
        aligned = len(key) - len(key) % PAGE
        if aligned < len(key):
            self.alloc.free(value[aligned:])
        self.cache.dec_lock_ref(match.last_node)
        self.check_invariants()
        return prefix

    def check_invariants(self, request_tokens: int = 0) -> None:
        """`request_tokens`: device slots running requests own (pages they computed, not yet inserted)."""
        nodes = list(self.cache._nodes())
        device = sum(len(n.value) for n in nodes if n.value is not None)
        assert self.alloc.available_size() + device + request_tokens == self.alloc.size, \
            "a device slot is neither free, cached nor a request's"
        assert self.host.used_tokens() == self.cache.tree_host_tokens(), "host pool occupancy != tree's host slots"
        assert device == self.cache.evictable_size() + self.cache.protected_size()
        for n in nodes:
            assert n.value is not None or n.host_value is not None, "a node with no copy stayed in the tree"
            if n.value is None:
                assert all(c.value is None for c in n.children.values()), "device-evicted node has device child"


def prompt(prefix_id: int, length: int, tail: int = 0) -> list[int]:
    rng = random.Random(prefix_id)
    return [rng.randrange(1, 1000) for _ in range(length)] + [5000 + prefix_id * 10 + i for i in range(tail)]


def test_eviction_demotes_and_a_hit_loads_back_from_host():
    h = Harness()
    a, b = prompt(1, 16), prompt(2, 16)
    h.request(a)
    h.request(b)  # the device pool (32 tokens) cannot hold both plus room: a is demoted
    assert h.cache.host_tokens() > 0
    assert h.request(a + [7, 7, 7, 7]) == 16  # a comes back from the host, slot contents checked
    assert h.cache.counters.loaded["host"] == 16


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_each_write_policy_serves_correct_kv_under_random_workloads(policy):
    h = Harness(policy)
    rng = random.Random(7)
    hits = 0
    for _ in range(60):
        key = prompt(rng.randrange(6), rng.choice([8, 12, 16]), tail=rng.choice([0, 3, 4]))
        hits += h.request(key)
    assert hits > 0
    assert h.cache.counters.loaded["host"] > 0


def test_write_policies_differ_in_when_the_host_copy_is_made():
    through, back, selective = Harness("write_through"), Harness("write_back"), Harness("write_through_selective")
    key = prompt(3, 8)
    for h in (through, back, selective):
        h.request(key)
    assert through.cache.host_tokens() == 8
    assert back.cache.host_tokens() == 0
    assert selective.cache.host_tokens() == 0
    for _ in range(2):
        match = selective.cache.match_prefix(key, record_stats=False)
        selective.cache.inc_lock_ref(match.last_node)
        selective.cache.record_admission(match.last_node, 8, {"host": 0, "disk": 0})
        selective.cache.dec_lock_ref(match.last_node)
    assert selective.cache.host_tokens() == 8


def test_locked_node_gets_its_write_through_copy_only_when_unlocked():
    h = Harness()
    key = prompt(4, 8)
    slots = h.alloc.alloc(8)
    h.write(slots, key, 0)
    h.cache.insert(key, slots)
    node = h.cache.match_prefix(key, record_stats=False).last_node
    h.cache.inc_lock_ref(node)
    h.cache._drain_pending()
    assert h.cache.host_tokens() == 0  # maybe still being computed by the forward in flight
    h.cache.dec_lock_ref(node)
    assert h.cache.host_tokens() == 8


def test_host_eviction_writes_to_storage_and_a_later_hit_loads_from_disk(tmp_path):
    h = Harness("write_back", device_tokens=16, host_tokens=24, storage_dir=tmp_path)
    keys = [prompt(i, 8) for i in range(6)]
    for key in keys:
        h.request(key)
    h.io.flush()
    assert len(list(tmp_path.iterdir())) > 0
    assert h.request(keys[0] + [1, 2]) == 8
    assert h.cache.counters.loaded["disk"] == 8


def test_a_second_cache_on_the_same_directory_reads_the_first_ones_pages(tmp_path):
    first = Harness(storage_dir=tmp_path)
    key = prompt(9, 12)
    first.request(key)
    first.io.flush()
    second = Harness(storage_dir=tmp_path)
    assert second.request(key + [3]) == 12
    assert second.cache.counters.loaded["disk"] == 12


def test_corrupt_page_is_a_miss_and_is_deleted(tmp_path):
    first = Harness(storage_dir=tmp_path)
    key = prompt(11, 12)
    first.request(key)
    first.io.flush()
    files = sorted(tmp_path.iterdir())
    assert len(files) == 3
    for path in files:  # flip one payload byte in each page: the checksum must catch it
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    second = Harness(storage_dir=tmp_path)
    assert second.request(key) == 0  # the bad first page is dropped; the prompt is recomputed (and stored again)
    assert second.cache.counters.corrupt_pages == 1
    second.io.flush()
    third = Harness(storage_dir=tmp_path)
    assert third.request(key) == PAGE  # the rewritten first page loads; the second is still bad: a miss
    assert third.cache.counters.corrupt_pages == 1


def test_storage_is_trimmed_to_max_bytes_oldest_first(tmp_path):
    h = Harness(storage_dir=tmp_path)
    page_bytes = None
    for i in range(8):
        h.request(prompt(20 + i, 8))
        h.io.flush()
        page_bytes = page_bytes or h.io.backend.bytes_used() // 2
    h.io.max_bytes = 5 * page_bytes
    h.request(prompt(40, 8))
    h.io.flush()
    assert h.io.backend.bytes_used() <= 5 * page_bytes
    first_key = h.io.key(h.cache._chain_hashes(h.cache.root, prompt(20, 8))[0])
    assert not h.io.backend.contains(first_key)  # the oldest went first


def test_events_carry_the_tier(tmp_path):
    h = Harness("write_through", device_tokens=16, host_tokens=24, storage_dir=tmp_path, events=True)
    for i in range(4):
        h.request(prompt(30 + i, 8))
    h.io.flush()
    events = h.cache.take_events()
    stored = {e.tier for e in events if isinstance(e, BlockStored)}
    removed = {e.tier for e in events if isinstance(e, BlockRemoved)}
    assert stored == {"device", "host", "disk"}
    assert "device" in removed


def test_flush_per_tier(tmp_path):
    h = Harness(storage_dir=tmp_path)
    key = prompt(50, 8)
    h.request(key)
    h.cache.flush("device")
    assert h.cache.evictable_size() == 0 and h.cache.host_tokens() == 8
    h.check_invariants()
    h.cache.flush("host")
    assert h.cache.host_tokens() == 0 and not h.cache.root.children
    h.check_invariants()
    h.io.flush()
    assert h.io.backend.bytes_used() > 0
    h.cache.flush("disk")
    assert h.io.backend.bytes_used() == 0
    h.request(key)
    h.cache.flush("all")
    assert h.alloc.available_size() == h.alloc.size and h.cache.host_tokens() == 0


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
@pytest.mark.parametrize("prefetch", ["best_effort", "wait_complete", "timeout"])
def test_interleaved_requests_under_every_policy_keep_the_invariants(tmp_path, policy, prefetch):
    """Up to three requests hold their prefixes locked while others match, load back and evict; every matched
    slot still holds its prefix's KV, and the tiers' accounting holds after each step."""
    h = Harness(policy, device_tokens=48, host_tokens=56, storage_dir=tmp_path, prefetch=prefetch,
                max_bytes=40_000)
    rng = random.Random(11)
    running = []
    for step in range(120):
        if running and (len(running) == 3 or rng.random() < 0.4):
            key, match, value, prefix = running.pop(rng.randrange(len(running)))
            present = h.cache.insert(key, value)
            h.alloc.free(value[prefix:present])
            aligned = len(key) - len(key) % PAGE
            if aligned < len(key):
                h.alloc.free(value[aligned:])
            h.cache.dec_lock_ref(match.last_node)
        else:
            key = prompt(rng.randrange(8), rng.choice([8, 12]), tail=rng.choice([0, 2, 4]))
            match = h.cache.match_prefix(key, record_stats=False)
            prefix = len(match.device_indices)
            h.check_slots(match.device_indices, key)
            h.cache.inc_lock_ref(match.last_node)
            need = len(key) - prefix + PAGE
            if h.alloc.available_size() < need:
                h.cache.evict(need - h.alloc.available_size())
            last = int(match.device_indices[-1]) if prefix else -1
            new = h.alloc.alloc_extend([prefix], [len(key)], [last])
            if new is None:
                h.cache.dec_lock_ref(match.last_node)
            else:
                h.write(new, key, prefix)
                running.append((key, match, torch.cat([match.device_indices, new]), prefix))
        own_pages = sum((len(value) - prefix + PAGE - 1) // PAGE for _, _, value, prefix in running)
        h.check_invariants(own_pages * PAGE)
    h.io.flush()
    assert h.io.backend.bytes_used() <= 40_000
    assert h.cache.counters.loaded["host"] > 0
    if prefetch == "wait_complete":  # the other policies use what the read threads finished in time
        assert h.cache.counters.loaded["disk"] > 0


def test_best_effort_uses_the_reads_started_when_the_request_arrived(tmp_path):
    first = Harness(storage_dir=tmp_path)
    key = prompt(60, 12)
    first.request(key)
    first.io.flush()
    second = Harness(storage_dir=tmp_path, prefetch="best_effort")
    second.cache.prefetch(key + [1])  # on arrival: reads start, the tree is untouched
    assert not second.cache.root.children and len(second.io._reads) == 3
    concurrent.futures.wait(list(second.io._reads.values()))
    assert second.request(key + [1]) == 12  # scheduled later: all three pages had arrived
    assert second.cache.counters.loaded["disk"] == 12 and not second.io._reads
