"""HiCache in the engine: a device pool far smaller than the workload's prefixes forces demotion to the host pool and
storage and load-back from both; greedy ids stay those of the engine without the hierarchy, in both loops, with
corrupt storage pages, and across two engines sharing one storage directory. Nothing leaks."""

from __future__ import annotations

import random
import time

import pytest

from tandem.common.config import ConfigError, EngineConfig
from tandem.common.engine import Engine
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tandem.common.telemetry.metrics import WorkerMetrics

BASE = dict(max_total_tokens=128, page_size=4, max_context_len=256, chunked_prefill_size=64)
HICACHE = dict(enable_hierarchical_cache=True, hicache_ratio=1.5, hicache_write_policy="write_through",
               hicache_storage_backend="file", hicache_storage_prefetch_policy="wait_complete")


def workload() -> list[list[int]]:
    """Two turns over six 40-token prefixes (240 tokens: ~2x the device pool, more than the host pool), the second
    in reverse order: the latest prefixes come back from the device and host, the oldest from storage."""
    rng = random.Random(3)
    prefixes = [[rng.randrange(3, 250) for _ in range(40)] for _ in range(6)]
    turns = [prefixes, prefixes[::-1]]
    return [p + [rng.randrange(3, 250) for _ in range(4 + turn)] for turn in range(2) for p in turns[turn]]


def run(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """One request at a time (the batch never changes the numerics): greedy ids and cached tokens of each."""
    outputs, cached = [], []
    for i, ids in enumerate(prompts):
        req = GenerateRequest(f"r{i}", ids, SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
        result = engine.submit(req).result()
        outputs.append(result.sequences[0].output_ids)
        cached.append(result.cached_tokens)
    return outputs, cached


def assert_nothing_leaks(engine: Engine) -> dict:
    report = engine.memory_report()
    assert report["leaked_tokens"] == 0
    assert report["protected_tokens"] == 0
    if "host_tokens" in report:
        assert report["host_tokens"] == report["host_tree_tokens"]
        assert report["storage_bytes"] <= engine.config.hicache_storage_max_bytes
    return report


@pytest.fixture(scope="module")
def reference(tiny_llama):
    with Engine(EngineConfig(model_path=tiny_llama, event_loop="normal", **BASE)) as engine:
        outputs, _ = run(engine, workload())
        assert_nothing_leaks(engine)
    return outputs


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_greedy_ids_match_without_the_hierarchy_while_pages_move_through_every_tier(tiny_llama, reference, loop,
                                                                                    tmp_path):
    config = EngineConfig(model_path=tiny_llama, event_loop=loop, hicache_storage_dir=str(tmp_path), **BASE,
                          **HICACHE)
    with Engine(config) as engine:
        outputs, cached = run(engine, workload())
        report = assert_nothing_leaks(engine)
    assert outputs == reference
    assert report["hit_host_tokens"] > 0, report
    assert report["hit_disk_tokens"] > 0, report
    assert sum(cached) == report["hit_device_tokens"] + report["hit_host_tokens"] + report["hit_disk_tokens"]


def test_corrupt_storage_pages_are_recomputed(tiny_llama, reference, tmp_path):
    config = EngineConfig(model_path=tiny_llama, event_loop="normal", hicache_storage_dir=str(tmp_path), **BASE,
                          **HICACHE)
    with Engine(config) as engine:
        run(engine, workload())
        assert_nothing_leaks(engine)
    pages = sorted(tmp_path.iterdir())
    assert pages
    for path in pages:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x5A
        path.write_bytes(bytes(data))
    with Engine(config) as engine:
        outputs, _ = run(engine, workload())
        report = assert_nothing_leaks(engine)
    assert outputs == reference
    assert report["corrupt_pages"] > 0


def test_a_second_engine_reuses_the_first_ones_storage(tiny_llama, reference, tmp_path):
    config = EngineConfig(model_path=tiny_llama, event_loop="overlap", hicache_storage_dir=str(tmp_path), **BASE,
                          **HICACHE)
    prompts = workload()[:6]
    with Engine(config) as first:
        run(first, prompts)
        assert_nothing_leaks(first)
    metrics = WorkerMetrics("unified")
    with Engine(config, metrics=metrics) as second:
        outputs, cached = run(second, prompts)
        report = assert_nothing_leaks(second)
    assert outputs == reference[:6]
    assert report["hit_disk_tokens"] > 0 and all(cached)
    def sample(name: str, **labels) -> float:
        return metrics.registry.get_sample_value(name, {"role": "unified", **labels})
    assert sample("tandem_hicache_hit_tokens_total", tier="disk") == report["hit_disk_tokens"]
    assert sample("tandem_hicache_bytes_total", tier="disk", direction="read") > 0
    assert sample("tandem_hicache_load_back_seconds_count") > 0
    assert sample("tandem_hicache_host_tokens") == report["host_tokens"]
    assert sample("tandem_hicache_storage_bytes") > 0


def flush(engine: Engine, tier: str) -> bool:
    """flush_cache refuses while the last request is still in the running batch; it leaves on the next step."""
    for _ in range(500):
        if engine.flush_cache(tier):
            return True
        time.sleep(0.01)
    return False


def test_flush_per_tier_and_bad_tier(tiny_llama, tmp_path):
    config = EngineConfig(model_path=tiny_llama, event_loop="normal", hicache_storage_dir=str(tmp_path), **BASE,
                          **HICACHE)
    with Engine(config) as engine:
        run(engine, workload()[:3])
        assert flush(engine, "device")
        report = assert_nothing_leaks(engine)
        assert report["cached_tokens"] == 0 and report["host_tokens"] > 0
        assert flush(engine, "host")
        assert assert_nothing_leaks(engine)["host_tokens"] == 0
        assert flush(engine, "disk")
        assert assert_nothing_leaks(engine)["storage_bytes"] == 0
        with pytest.raises(Exception, match="tier"):
            engine.flush_cache("l4")


@pytest.mark.parametrize("overrides, flag", [
    (dict(hicache_storage_backend="file", hicache_storage_dir="/tmp/x"), "--enable-hierarchical-cache"),
    (dict(enable_hierarchical_cache=True, hicache_storage_backend="file"), "--hicache-storage-dir"),
    (dict(enable_hierarchical_cache=True, disable_radix_cache=True), "--disable-radix-cache"),
    (dict(enable_hierarchical_cache=True, hicache_ratio=1.0), "--hicache-ratio"),
    (dict(enable_hierarchical_cache=True, hicache_write_policy="sometimes"), "--hicache-write-policy"),
    (dict(enable_hierarchical_cache=True, hicache_storage_prefetch_policy="eager"),
     "--hicache-storage-prefetch-policy"),
])
def test_bad_flags_are_refused_naming_the_flag(tiny_llama, overrides, flag):
    with pytest.raises(ConfigError, match=flag):
        EngineConfig(model_path=tiny_llama, **overrides).validate()


def test_a_host_pool_not_larger_than_the_device_pool_is_refused(tiny_llama):
    config = EngineConfig(model_path=tiny_llama, enable_hierarchical_cache=True, hicache_size=1e-6, **BASE)
    with pytest.raises(ConfigError, match="--hicache-size"):
        Engine(config)


def test_weight_update_and_memory_release_keep_the_tiers_coherent(tiny_llama, reference, tmp_path):
    """A weight update empties L1 and L2 and moves L3 keys to the new version (no page of the old weights can
    match); releasing the KV memory empties L1 and L2 together."""
    config = EngineConfig(model_path=tiny_llama, event_loop="normal", hicache_storage_dir=str(tmp_path), **BASE,
                          **HICACHE)
    prompts = workload()[:2]
    with Engine(config) as engine:
        run(engine, prompts)
        assert assert_nothing_leaks(engine)["storage_pages"] > 0
        engine.control.update_from_disk(tiny_llama, "v2", False)
        report = assert_nothing_leaks(engine)
        assert report["host_tokens"] == 0 and report["cached_tokens"] == 0
        outputs, cached = run(engine, prompts)
        assert outputs == reference[:2] and cached == [0, 0]  # same weights, but the old version's pages stay unused
        engine.control.release_memory(["kv_cache"])
        report = assert_nothing_leaks(engine)
        assert report["host_tokens"] == 0 and report["free_tokens"] == report["total_tokens"]
        engine.control.resume_memory(["kv_cache"])
        outputs, cached = run(engine, prompts)
    assert outputs == reference[:2] and all(cached)  # the v2 pages from storage
