"""Greedy parity end to end: the engine on the cpu backend (the CPU default) against the torch backend."""

from __future__ import annotations

import random

import pytest

from tandem.common.config import ConfigError, EngineConfig
from tandem.common.engine import Engine
from tandem.common.model.attention.cpu_backend import CpuAttentionBackend
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest

MAX_NEW = 8


def _prompts() -> list[list[int]]:
    """Mixed lengths (one past a 32-token row block and a 64-key block), two sharing a 40-token prefix so the
    second extend starts from a cached prefix read from the pool."""
    rng = random.Random(11)
    shared = [rng.randrange(8, 512) for _ in range(40)]
    return [[rng.randrange(8, 512) for _ in range(n)] for n in (1, 9, 70)] + [shared + [11, 12], shared + [13]]


def _generate(model_dir: str, **overrides):
    config = EngineConfig(model_path=model_dir, max_total_tokens=2048, page_size=4, chunked_prefill_size=32,
                          **overrides)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with Engine(config) as engine:
        backend = engine.model.attn_backend
        prompts = _prompts()
        # The first three run as one batch; the prefix pair after, so the shared prefix is in the radix cache.
        reqs = [GenerateRequest(f"r{i}", p, params, return_logprob=True) for i, p in enumerate(prompts)]
        results = engine.generate(reqs[:3]) + engine.generate(reqs[3:4]) + engine.generate(reqs[4:])
        stats = engine.stats()
        assert engine.flush_cache()
        memory = engine.memory_report()
    assert memory["free_tokens"] == memory["total_tokens"] and memory["leaked_tokens"] == 0, memory
    assert memory["free_req_slots"] == memory["total_req_slots"], memory
    return [r.sequences[0] for r in results], stats, backend


@pytest.fixture(scope="module")
def torch_reference(tiny_llama):
    return _generate(tiny_llama, attention_backend="torch", event_loop="normal", dtype="float32")[0]


@pytest.mark.parametrize("event_loop", ["normal", "overlap"])
def test_cpu_backend_is_the_default_and_matches_torch_backend(tiny_llama, torch_reference, event_loop):
    got, stats, backend = _generate(tiny_llama, event_loop=event_loop, dtype="float32")  # --attention-backend auto
    assert isinstance(backend, CpuAttentionBackend)
    assert stats["cache_hit_tokens"] >= 40  # the last prompt's extend attended a prefix read from the pool
    for seq, ref in zip(got, torch_reference):
        assert seq.output_ids == ref.output_ids
        assert max(abs(a - b) for a, b in zip(seq.logprobs, ref.logprobs)) < 1e-4


def test_bfloat16_loops_agree_and_start_like_torch_backend(tiny_llama):
    """bf16 greedy runs can part at a near-tie later on (the torch backend rounds scores and probabilities to bf16,
    the C++ ops keep float32), so: both loops give the same tokens, and each request's first token (its prefill,
    prefix-cached or not) and its logprob match the torch backend."""
    normal = _generate(tiny_llama, event_loop="normal", dtype="bfloat16")[0]
    overlap = _generate(tiny_llama, event_loop="overlap", dtype="bfloat16")[0]
    reference = _generate(tiny_llama, attention_backend="torch", event_loop="normal", dtype="bfloat16")[0]
    for a, b, ref in zip(normal, overlap, reference):
        assert a.output_ids == b.output_ids
        assert a.output_ids[0] == ref.output_ids[0] and abs(a.logprobs[0] - ref.logprobs[0]) < 0.1


def test_cpu_backend_on_cuda_is_a_clear_start_up_error(tiny_llama):
    with pytest.raises(ConfigError, match="--attention-backend cpu runs on CPU only"):
        EngineConfig(model_path=tiny_llama, device="cuda", attention_backend="cpu").validate()
    assert EngineConfig(model_path=tiny_llama, device="cuda").resolved_attention_backend == "triton"
    assert EngineConfig(model_path=tiny_llama).resolved_attention_backend == "cpu"


def test_missing_compiler_is_a_start_up_error(tiny_llama, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    with pytest.raises(ConfigError, match="'no-such-c\\+\\+-compiler'.*not on PATH"):
        EngineConfig(model_path=tiny_llama).validate()
    EngineConfig(model_path=tiny_llama, attention_backend="torch").validate()  # torch needs no compiler
