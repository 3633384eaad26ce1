"""The CUDA paths, on a machine with a GPU: decode through CUDA graphs (torch and triton attention backends) and the
compiled Triton kernels, greedy-equal to eager decoding and to the CPU engine; the FlashInfer backend against the
torch backend layer by layer and against the triton backend end to end. CI has no GPU, so these skip there; they
run where `torch.cuda.is_available()` (run this file alone: other test modules force Triton's interpreter)."""

from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest
import torch

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest

pytestmark = [pytest.mark.needs_gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MAX_NEW = 12


def _prompts() -> list[list[int]]:
    """Ragged lengths (batches of 1..5 decode rows pad into buckets) and a shared 40-token prefix (a radix hit)."""
    rng = random.Random(11)
    shared = [rng.randrange(8, 512) for _ in range(40)]
    return ([[rng.randrange(8, 512) for _ in range(n)] for n in (1, 7, 33, 70, 129)]
            + [shared + [21, 22], shared + [23]])


def _flush(engine: Engine) -> None:
    """Empty the radix cache; the loop may still be filing the last finished request for a moment."""
    deadline = time.monotonic() + 10
    while not engine.flush_cache():
        assert time.monotonic() < deadline, engine.memory_report()
        time.sleep(0.01)


def _generate(model_dir: str, device: str, **overrides) -> tuple[list, dict]:
    config = EngineConfig(model_path=model_dir, device=device, **{
        "dtype": "float32", "max_total_tokens": 4096, "page_size": 16, "chunked_prefill_size": 64, **overrides})
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with Engine(config) as engine:
        prompts = _prompts()
        reqs = [GenerateRequest(f"r{i}", p, params, return_logprob=True, top_logprobs_num=2)
                for i, p in enumerate(prompts)]
        results = engine.generate(reqs[:5]) + engine.generate(reqs[5:6]) + engine.generate(reqs[6:])
        replays = engine.graph_runner.replays if engine.graph_runner is not None else 0
        stats = engine.stats()
        _flush(engine)
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


@pytest.fixture(scope="module")
def cpu_fp8_reference(tiny_llama):
    return _generate(tiny_llama, "cpu", attention_backend="torch", kv_cache_dtype="fp8_e4m3")[0]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_cuda_graph_decode_on_fp8_kv_matches_cpu(tiny_llama, cpu_reference, cpu_fp8_reference, kv_cache_dtype):
    """The compiled Triton kernels on an FP8 pool, through CUDA graphs: e4m3 greedy-equal to the CPU torch backend
    on the same FP8 cache; e5m2 (never run on a GPU here) close to the unquantized CPU run at the first token."""
    got, stats = _generate(tiny_llama, "cuda", attention_backend="triton", kv_cache_dtype=kv_cache_dtype)
    assert stats["graph_replays"] > 0
    if kv_cache_dtype == "fp8_e4m3":
        _assert_same(got, cpu_fp8_reference, 1e-3)
    else:
        assert all(abs(g.logprobs[0] - r.logprobs[0]) < 0.1 for g, r in zip(got, cpu_reference))


def test_triton_kernels_compiled_not_interpreted():
    from tandem.common.model.attention.triton_kernels import kernels_interpreted

    assert not kernels_interpreted()


@pytest.mark.e2e
def test_bench_offline_on_cuda_with_the_documented_flags(tiny_llama, tmp_path):
    """docs/performance.md's GPU command (`tandem bench offline --device cuda ... --attention-backend triton`),
    on the tiny model with a small workload."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "offline.json"
    argv = [sys.executable, "-m", "tandem.common.cli", "bench", "offline", "--model", tiny_llama, "--device", "cuda",
            "--dtypes", "bfloat16", "--attention-backend", "triton", "--num-prompts", "8", "--input-len", "16",
            "--output-len", "8", "--max-running-requests", "8", "--skip-hf", "--output-json", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())["results"]
    assert row["output_tokens"] == 8 * 8 and row["tokens_per_s"] > 0


@pytest.mark.e2e
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


# FlashInfer runs float16/bfloat16 only. It is checked on the small preset (head dim 64, 2 query heads per KV head):
# in bfloat16 against the torch backend on the same tensors and in a PD pair against itself in process, and end to
# end in float16 (finer rounding, so a tighter bound) against the triton backend.


def _assert_greedy_close(got, ref, tie: float = 0.1, logprob_tol: float = 0.1) -> None:
    """Two reduced-precision runs of one model with different attention kernels: equal ids, except that a sequence
    may leave the reference where the reference's top two candidates were within `tie` nats and it took the
    second (the rest of it is then another continuation, not compared); equal logprobs on the shared part; and
    most of every run shared. Rounding moves a logprob by hundredths between kernels that sum in another order
    (in float16; bfloat16's three fewer bits move it by up to ~0.15); a wrong kernel moves it by nats."""
    shared, worst = 0, 0.0
    for n, (seq, want) in enumerate(zip(got, ref)):
        for t, (a, b) in enumerate(zip(seq.output_ids, want.output_ids)):
            if a != b:
                (first, lp1), (second, lp2) = want.top_logprobs[t][:2]  # an exact tie may list either first
                assert a in (first, second) and lp1 - lp2 < tie, (n, t, a, want.top_logprobs[t])
                break
            worst = max(worst, abs(seq.logprobs[t] - want.logprobs[t]))
            assert worst < logprob_tol, (n, t, seq.logprobs[t], want.logprobs[t])
            shared += 1
    total = sum(len(w.output_ids) for w in ref)
    print(f"greedy ids shared with the reference: {shared}/{total}, worst logprob difference {worst:.4f}")
    assert shared >= 0.8 * total, shared


@pytest.fixture(scope="module")
def small_llama(model_factory):
    return model_factory("llama", "small")


@pytest.fixture(scope="module")
def triton_fp16_reference(small_llama):
    return _generate(small_llama, "cuda", dtype="float16", attention_backend="triton")[0]


def _pools(num_heads: int, kv_heads: int, head_dim: int):
    from tandem.common.memory.kv_pool import MHATokenToKVPool
    from tandem.common.memory.req_to_token import ReqToTokenPool

    pool = MHATokenToKVPool(4096, 16, torch.bfloat16, 1, kv_heads, head_dim, device="cuda")
    pool.k_buffers[0].normal_()
    pool.v_buffers[0].normal_()
    return pool, ReqToTokenPool(8, 1024, device="cuda")


def _batch(mode, r2t, pool, prefix_lens: list[int], new_lens: list[int]):
    """Requests with `prefix_lens` tokens in the pool and `new_lens` to run, at scattered slots (a gap after each)."""
    from tandem.common.model.forward_batch import ForwardBatch

    slot, locs = 16, []
    for i, (p, n) in enumerate(zip(prefix_lens, new_lens)):
        r2t.req_to_token[i, : p + n] = torch.arange(slot, slot + p + n)
        locs.append(torch.arange(slot + p, slot + p + n))
        slot += p + n + 37

    def t(x):
        return torch.tensor(x, dtype=torch.int64, device="cuda")

    seq = [p + n for p, n in zip(prefix_lens, new_lens)]
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, new_lens)]).cuda()
    return ForwardBatch(mode, len(seq), t([1] * sum(new_lens)), positions, torch.cat(locs).cuda(),
                        t(list(range(len(seq)))), t(seq), t(prefix_lens), t(new_lens), r2t, pool, seq, prefix_lens,
                        new_lens)


def test_flashinfer_attention_matches_torch_backend():
    """Extend (with and without cached prefixes, ragged) and decode, and decode through the graph plan hooks:
    FlashInfer's output equals the torch backend's on the same q/k/v and pool, to bfloat16 rounding."""
    from tandem.common.model.attention.flashinfer_backend import FlashInferAttentionBackend
    from tandem.common.model.attention.torch_backend import TorchAttentionBackend
    from tandem.common.model.forward_batch import ForwardMode
    from tandem.common.model.graph_runner import DecodeGraphRunner

    heads, kv_heads, dim = 8, 4, 64
    pool, r2t = _pools(heads, kv_heads, dim)
    flash = FlashInferAttentionBackend("cuda")
    flash.configure(heads, kv_heads, dim, torch.bfloat16)
    reference = TorchAttentionBackend("cuda")
    torch.manual_seed(0)
    cases = [(ForwardMode.EXTEND, [0, 0, 0], [5, 64, 130]), (ForwardMode.EXTEND, [40, 0, 300], [7, 33, 1]),
             (ForwardMode.DECODE, [0, 17, 63, 500], [1, 1, 1, 1])]
    for mode, prefix_lens, new_lens in cases:
        fb = _batch(mode, r2t, pool, prefix_lens, new_lens)
        tokens = sum(new_lens)
        q = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        outs = []
        for backend in (reference, flash):
            run = replace(fb)
            backend.init_forward_metadata(run)
            outs.append(backend.forward(q, k, v, 0, run).float())
        assert (outs[0] - outs[1]).abs().max().item() < 2e-2, (mode, prefix_lens, new_lens)
    # The graph hooks: a bucket of 8 captured on a plan for the whole context, replaying the 4-request decode.
    flash.init_graph_state(8, r2t.max_context_len)
    runner = DecodeGraphRunner.__new__(DecodeGraphRunner)
    runner.batch_sizes, runner.max_bs = [8], 8
    padded = DecodeGraphRunner.pad(runner, fb)
    static = replace(padded, seq_lens_cpu=[r2t.max_context_len] * 8)
    flash.init_graph_metadata(static)
    flash.init_forward_metadata(padded)
    flash.replay_graph_metadata(static, padded)
    pad = padded.batch_size - fb.batch_size
    grown = [torch.cat([x, x[:1].expand(pad, *x.shape[1:])]) for x in (q, k, v)]
    graph_out = flash.forward(*grown, 0, replace(static, out_cache_loc=padded.out_cache_loc))
    assert (graph_out[: fb.batch_size].float() - outs[0]).abs().max().item() < 2e-2


@pytest.mark.parametrize("event_loop,overrides", [
    ("normal", {}), ("overlap", {}), ("overlap", {"disable_cuda_graph": True, "enable_mixed_chunk": True})],
    ids=["normal-graphs", "overlap-graphs", "overlap-eager-mixed"])
def test_flashinfer_engine_matches_triton(small_llama, triton_fp16_reference, event_loop, overrides):
    got, stats = _generate(small_llama, "cuda", dtype="float16", attention_backend="flashinfer",
                           event_loop=event_loop, **overrides)
    assert (stats["graph_replays"] > 0) != bool(overrides.get("disable_cuda_graph"))
    _assert_greedy_close(got, triton_fp16_reference)


@pytest.mark.e2e
def test_pd_pair_with_flashinfer(small_llama):
    """A prefill worker and a decode worker on FlashInfer (VRAM KV through NIXL): the in-process FlashInfer
    engine's greedy output, up to near-ties, and every page back in both pools."""
    pytest.importorskip("nixl_cu12")
    from tests.services.pd_helpers import PDPair, output_ids

    reference = _generate(small_llama, "cuda", dtype="bfloat16", attention_backend="flashinfer")[0]
    pair = PDPair(small_llama, "--device", "cuda", "--dtype", "bfloat16", "--attention-backend", "flashinfer")
    try:
        prompts = _prompts()
        reqs = [pair.request(f"pd{i}", p, max_new_tokens=MAX_NEW, ignore_eos=True) for i, p in enumerate(prompts)]
        got = [output_ids(d) for _, d in pair.run_legs(reqs)]
        ids_only = [replace(want, output_ids=ids, logprobs=want.logprobs) for ids, want in zip(got, reference)]
        _assert_greedy_close(ids_only, reference, logprob_tol=float("inf"))
        pair.wait_both_free()
    finally:
        pair.close()
