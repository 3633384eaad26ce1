"""How the Engine sizes its KV pool when --max-total-tokens is not given."""

from __future__ import annotations

from tandem.common import engine
from tandem.common.config import EngineConfig


def test_cpu_pool_follows_the_context_bounded_by_memory(monkeypatch):
    monkeypatch.setattr(engine, "_available_ram", lambda: 64 * 2**30)
    config = EngineConfig(page_size=16)
    # Plenty of RAM: room for CPU_POOL_SEQUENCES full-context sequences, page-aligned, not 25 % of RAM.
    tokens = engine.kv_pool_tokens(config, bytes_per_token=16384, max_context_len=4096)
    assert tokens == engine.CPU_POOL_SEQUENCES * (4096 + 16)
    assert tokens * 16384 < 0.25 * 64 * 2**30
    # Little RAM: --mem-fraction of it bounds the pool.
    monkeypatch.setattr(engine, "_available_ram", lambda: 2**30)
    tokens = engine.kv_pool_tokens(config, bytes_per_token=16384, max_context_len=4096)
    assert tokens == (2**30 // 4) // 16384 // 16 * 16


def test_max_total_tokens_wins():
    config = EngineConfig(page_size=16, max_total_tokens=1000)
    assert engine.kv_pool_tokens(config, bytes_per_token=1, max_context_len=10**6) == 992


def test_mem_fraction_static_is_a_share_of_the_whole_device_weights_included(monkeypatch):
    gib = 2**30
    # 80 GiB device, 20 GiB in use (the weights): 0.5 of the total leaves 20 GiB for the pool; --mem-fraction 0.25
    # would have taken a quarter of the 60 GiB free.
    monkeypatch.setattr(engine.torch.cuda, "mem_get_info", lambda device: (60 * gib, 80 * gib))
    static = EngineConfig(page_size=16, device="cuda", mem_fraction_static=0.5)
    assert engine.kv_pool_tokens(static, bytes_per_token=gib // 1024, max_context_len=4096) == 20 * 1024
    plain = EngineConfig(page_size=16, device="cuda", mem_fraction=0.25)
    assert engine.kv_pool_tokens(plain, bytes_per_token=gib // 1024, max_context_len=4096) == 15 * 1024
