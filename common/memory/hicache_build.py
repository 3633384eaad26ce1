"""Builds the HiRadixCache a config asks for: the host pool sized from the device pool, the L3 backend and its IO."""

from __future__ import annotations

from typing import Callable

from tandem.common.config import ConfigError, EngineConfig
from tandem.common.memory.allocator import PagedTokenToKVPoolAllocator
from tandem.common.memory.hicache_io import StorageIO
from tandem.common.memory.hicache_page import PageLayout, model_identity
from tandem.common.memory.hicache_storage import make_storage_backend
from tandem.common.memory.hiradix_cache import HiRadixCache
from tandem.common.memory.host_pool import HostKVPool, host_pool_tokens
from tandem.common.memory.kv_pool import MHATokenToKVPool
from tandem.common.telemetry.metrics import HiCacheMetrics


def build_hicache(config: EngineConfig, kv_pool: MHATokenToKVPool, allocator: PagedTokenToKVPoolAllocator,
                  enable_events: bool, metrics: HiCacheMetrics) -> HiRadixCache:
    tokens = host_pool_tokens(kv_pool.size, config.page_size, config.hicache_ratio, config.hicache_size,
                              kv_pool.bytes_per_token())
    if tokens <= kv_pool.size:
        flag = f"--hicache-size {config.hicache_size}" if config.hicache_size > 0 else \
            f"--hicache-ratio {config.hicache_ratio}"
        raise ConfigError(f"{flag}: the host pool ({tokens} tokens) must be larger than the device KV pool "
                          f"({kv_pool.size} tokens)")
    host_pool = HostKVPool(kv_pool, tokens)
    storage_io = None
    if config.hicache_storage_backend != "none":
        backend = make_storage_backend(config.hicache_storage_backend, config.hicache_storage_dir,
                                       config.hicache_storage_max_bytes)
        identity = model_identity(config.model_path, page_layout(kv_pool), config.weight_version)
        storage_io = StorageIO(backend, config.hicache_storage_max_bytes, identity,
                               config.hicache_storage_prefetch_policy, config.hicache_storage_prefetch_timeout_s,
                               metrics, emit_events=enable_events)
    return HiRadixCache(allocator, config.page_size, host_pool, config.hicache_write_policy, storage_io,
                        enable_events=enable_events, metrics=metrics)


def page_layout(kv_pool: MHATokenToKVPool) -> PageLayout:
    return PageLayout(kv_pool.num_layers, kv_pool.page_size, kv_pool.num_kv_heads, kv_pool.head_dim, kv_pool.dtype)


def identity_follower(config: EngineConfig, cache: HiRadixCache) -> Callable[[str], None]:
    """A weight-version listener: L3 keys fold in the version, so pages of old weights never match new ones."""
    def follow(version: str) -> None:
        cache.storage_io.set_identity(model_identity(config.model_path, cache.layout, version))
    return follow
