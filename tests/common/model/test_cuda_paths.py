"""The CUDA paths, on a machine with a GPU: decode through CUDA graphs (torch and triton attention backends) and the
compiled Triton kernels, greedy-equal to eager decoding and to the CPU engine. CI has no GPU, so these skip there;
they run where `torch.cuda.is_available()` (run this file alone: other test modules force Triton's interpreter)."""

from __future__ import annotations

import random

import pytest
import torch

from common.config import EngineConfig
from common.engine import Engine
from common.sampling.params import SamplingParams
from common.scheduler.io_struct import GenerateRequest

pytestmark = [pytest.mark.needs_gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MAX_NEW = 12


def _prompts() -> list[list[int]]:
    """Ragged lengths (batches of 1..5 decode rows pad into buckets) and a shared 40-token prefix (a radix hit)."""
    rng = random.Random(11)
    shared = [rng.randrange(8, 512) for _ in range(40)]
    return ([[rng.randrange(8, 512) for _ in range(n)] for n in (1, 7, 33, 70, 129)]
            + [shared + [21, 22], shared + [23]])


def _generate(model_dir: str, device: str, **overrides) -> tuple[list, dict]:
    config = EngineConfig(model_path=model_dir, device=device, dtype="float32", max_total_tokens=4096, page_size=16,
                          chunked_prefill_size=64, **overrides)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with Engine(config) as engine:
        prompts = _prompts()
        reqs = [GenerateRequest(f"r{i}", p, params, return_logprob=True) for i, p in enumerate(prompts)]
        results = engine.generate(reqs[:5]) + engine.generate(reqs[5:6]) + engine.generate(reqs[6:])
        replays = engine.graph_runner.replays if engine.graph_runner is not None else 0
        stats = engine.stats()
        assert engine.flush_cache()
        memory = engine.memory_report()
    assert memory["free_tokens"] == memory["total_tokens"] and memory["leaked_tokens"] == 0, memory
    return [r.sequences[0] for r in results], {**stats, "graph_replays": replays}


@pytest.fixture(scope="module")
def cpu_reference(tiny_llama):
    return _generate(tiny_llama, "cpu", attention_backend="torch")[0]


def _assert_same(got, ref, tol: float) -> None:
    for seq, want in zip(got, ref):
        assert seq.output_ids == want.output_ids
        assert max(abs(a - b) for a, b in zip(seq.logprobs, want.logprobs)) < tol


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("event_loop", ["normal", "overlap"])
def test_cuda_graph_decode_matches_cpu(tiny_llama, cpu_reference, backend, event_loop):
    got, stats = _generate(tiny_llama, "cuda", attention_backend=backend, event_loop=event_loop)
    assert stats["graph_replays"] > 0  # decode steps really replayed a captured graph
    assert stats["cache_hit_tokens"] >= 32
    _assert_same(got, cpu_reference, 1e-3)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_eager_matches_cpu(tiny_llama, cpu_reference, backend):
    got, stats = _generate(tiny_llama, "cuda", attention_backend=backend, disable_cuda_graph=True)
    assert stats["graph_replays"] == 0
    _assert_same(got, cpu_reference, 1e-3)


def test_triton_kernels_compiled_not_interpreted():
    from common.model.attention.triton_kernels import kernels_interpreted

    assert not kernels_interpreted()


def test_pd_pair_on_cuda_moves_vram_kv_through_nixl(tiny_llama, cpu_reference):
    """Prefill and decode with their KV pools in GPU memory (NIXL mem_type VRAM), decode on CUDA graphs with the
    triton backend: greedy-equal to the CPU engine, every page back in both pools."""
    pytest.importorskip("nixl_cu12")
    from tests.services.pd_helpers import PDPair, output_ids

    pair = PDPair(tiny_llama, "--device", "cuda", "--dtype", "float32", "--attention-backend", "triton")
    try:
        prompts = _prompts()
        reqs = [pair.request(f"pd{i}", p, max_new_tokens=MAX_NEW, ignore_eos=True) for i, p in enumerate(prompts)]
        results = pair.run_legs(reqs)
        assert [output_ids(d) for _, d in results] == [seq.output_ids for seq in cpu_reference]
        pair.wait_both_free()
    finally:
        pair.close()
