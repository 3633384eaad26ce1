"""Worker selection policies pick as specified; cache_aware follows the worker that holds the prompt's prefix."""

from __future__ import annotations

import random

from tandem.common.memory.page_hash import page_hashes
from tandem.services.router.kv_index import DISK, HOST, KvBlockIndex
from tandem.services.router.policies import (CacheAware, LeastLoad, PowerOfTwo, Random, RoundRobin, RouteRequest,
                                             make_policy)


class FakeWorker:
    def __init__(self, name: str, load: int = 0, page_size: int = 4):
        self.name = name
        self.load = load
        self.kv_index = KvBlockIndex(page_size)

    def load_score(self) -> int:
        return self.load

    def cache(self, token_ids: list[int], lora_id: str = "", tier: int | None = None) -> None:
        hashes = page_hashes(token_ids, self.kv_index.page_size, lora_id)
        self.kv_index.add(hashes) if tier is None else self.kv_index.add(hashes, tier)


PROMPT = list(range(100, 140))


def test_round_robin_cycles_through_workers_in_order():
    workers = [FakeWorker("a"), FakeWorker("b"), FakeWorker("c")]
    policy = RoundRobin()
    assert [policy.pick(workers, RouteRequest(PROMPT)).name for _ in range(6)] == list("abcabc")


def test_random_uses_every_worker():
    workers = [FakeWorker("a"), FakeWorker("b"), FakeWorker("c")]
    policy = Random(random.Random(0))
    assert {policy.pick(workers, RouteRequest(PROMPT)).name for _ in range(60)} == {"a", "b", "c"}


def test_least_load_picks_the_idlest_worker():
    workers = [FakeWorker("a", 5), FakeWorker("b", 1), FakeWorker("c", 3)]
    assert LeastLoad().pick(workers, RouteRequest(PROMPT)).name == "b"


def test_power_of_two_never_picks_the_busiest_of_three():
    workers = [FakeWorker("a", 9), FakeWorker("b", 1), FakeWorker("c", 2)]
    policy = PowerOfTwo(random.Random(1))
    picks = [policy.pick(workers, RouteRequest(PROMPT)).name for _ in range(100)]
    assert "a" not in picks and {"b", "c"} == set(picks)


def test_cache_aware_picks_the_worker_holding_the_longest_prefix():
    a, b, c = FakeWorker("a", 2), FakeWorker("b", 3), FakeWorker("c", 0)
    a.cache(PROMPT[:8])
    b.cache(PROMPT[:24])  # longest cached prefix, though not the least loaded
    assert CacheAware().pick([a, b, c], RouteRequest(PROMPT)).name == "b"


def test_cache_aware_prefers_a_prefix_on_device_or_host_over_the_same_prefix_on_disk():
    disk, host, device = FakeWorker("disk", 0), FakeWorker("host", 1), FakeWorker("device", 2)
    disk.cache(PROMPT[:24], tier=DISK)
    host.cache(PROMPT[:24], tier=HOST)
    assert CacheAware().pick([disk, host], RouteRequest(PROMPT)).name == "host"
    device.cache(PROMPT[:24])
    assert CacheAware().pick([disk, host, device], RouteRequest(PROMPT)).name == "device"


def test_cache_aware_weighs_a_longer_prefix_on_disk_against_a_shorter_one_on_device():
    disk, device = FakeWorker("disk", 0), FakeWorker("device", 0)
    disk.cache(PROMPT[:40], tier=DISK)  # 10 pages x 0.3 = 3.0
    device.cache(PROMPT[:8])  # 2 pages x 1.0
    assert CacheAware().pick([device, disk], RouteRequest(PROMPT)).name == "disk"
    device.cache(PROMPT[:16])  # 4 pages x 1.0 beat 10 disk pages
    assert CacheAware().pick([disk, device], RouteRequest(PROMPT)).name == "device"


def test_cache_aware_counts_only_prefixes_cached_under_the_requests_adapter():
    base, lora_a = FakeWorker("base", 1), FakeWorker("a", 2)
    base.cache(PROMPT[:24])
    lora_a.cache(PROMPT[:8], "A")
    assert CacheAware().pick([base, lora_a], RouteRequest(PROMPT, "A")).name == "a"
    assert CacheAware().pick([base, lora_a], RouteRequest(PROMPT)).name == "base"
    lora_a.load = 0  # B's request finds no prefix anywhere: the least loaded
    assert CacheAware().pick([base, lora_a], RouteRequest(PROMPT, "B")).name == "a"


def test_cache_aware_requires_the_chain_from_the_first_page():
    a, b = FakeWorker("a", 0), FakeWorker("b", 1)
    b.kv_index.add(page_hashes(PROMPT, 4)[1:])  # later pages without the first: no usable prefix
    assert CacheAware().pick([a, b], RouteRequest(PROMPT)).name == "a"


def test_cache_aware_without_any_cached_prefix_balances_load():
    workers = [FakeWorker("a", 4), FakeWorker("b", 1)]
    assert CacheAware().pick(workers, RouteRequest(PROMPT)).name == "b"


def test_cache_aware_spreads_uncached_prompts_over_idle_workers_stably():
    workers = [FakeWorker("a"), FakeWorker("b"), FakeWorker("c")]
    policy = CacheAware()
    prompts = [[g] * 8 + list(range(200, 240)) for g in range(30)]
    homes = [policy.pick(workers, RouteRequest(p)).name for p in prompts]
    assert set(homes) == {"a", "b", "c"}  # new prefix groups do not all pile onto the first idle worker
    assert homes == [policy.pick(workers, RouteRequest(p)).name for p in prompts]  # and come home again


def test_cache_aware_gives_up_affinity_when_the_holder_is_overloaded():
    busy, idle = FakeWorker("busy", 40), FakeWorker("idle", 2)
    busy.cache(PROMPT)
    policy = CacheAware(abs_threshold=8, rel_threshold=1.5)
    assert policy.pick([busy, idle], RouteRequest(PROMPT)).name == "idle"
    busy.load = 6  # within the threshold: the cache wins again
    assert policy.pick([busy, idle], RouteRequest(PROMPT)).name == "busy"


def test_make_policy_knows_every_name():
    for name in ("round_robin", "random", "least_load", "power_of_two", "cache_aware"):
        assert make_policy(name).name == name
