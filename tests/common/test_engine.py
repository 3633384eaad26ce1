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
