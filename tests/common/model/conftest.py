"""Fixtures for model tests: a tiny slot allocator and a runner that lays requests out in the paged pool."""

from __future__ import annotations

import pytest
import torch

from tandem.common.memory.kv_pool import MHATokenToKVPool
from tandem.common.memory.req_to_token import ReqToTokenPool
from tandem.common.model.forward_batch import ForwardBatch, ForwardMode


class PagedSlots:
    """Test-only KV slot allocator: whole pages (never page 0), handed out in a shuffled order so that
    a request's pages are not contiguous."""

    def __init__(self, size: int, page_size: int, seed: int = 0):
        self.page_size = page_size
        pages = torch.randperm(size // page_size, generator=torch.Generator().manual_seed(seed)) + 1
        self.free_pages = pages.tolist()

    def slots_for(self, row: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """Slots for positions [start, start+count) of one request, reusing its last partial page."""
        out = []
        for pos in range(start, start + count):
            if pos % self.page_size == 0:
                page = self.free_pages.pop()
                out.append(page * self.page_size)
            else:
                out.append(int(row[pos - 1]) + 1)
            row[pos] = out[-1]
        return torch.tensor(out, dtype=torch.int64)


def paged_forward_batch(mode, prefix, ext, page_size, pool, req_pool, gen):
    """Lay out requests with `prefix[i]` cached tokens and `ext[i]` new ones on shuffled pages; fill the
    prefixes' K/V in every layer with random values (the new tokens' K/V come with the forward)."""
    slots = PagedSlots(pool.size, page_size, seed=int(torch.randint(0, 1000, (1,), generator=gen)))
    rows, locs = [], []
    for i, (p, e) in enumerate(zip(prefix, ext)):
        row = req_pool.req_to_token[i]
        rows.append(i)
        prefix_locs = slots.slots_for(row, 0, p)
        for layer in range(pool.num_layers):
            k_buf, v_buf = pool.get_kv_buffer(layer)
            k_buf[prefix_locs] = torch.randn(p, *k_buf.shape[1:], generator=gen).to(pool.dtype)
            v_buf[prefix_locs] = torch.randn(p, *v_buf.shape[1:], generator=gen).to(pool.dtype)
        locs.append(slots.slots_for(row, p, e))
    seq = [p + e for p, e in zip(prefix, ext)]
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return ForwardBatch(mode=mode, batch_size=len(prefix), input_ids=t([0] * sum(ext)), positions=t([0] * sum(ext)),
                        out_cache_loc=torch.cat(locs), req_pool_indices=t(rows), seq_lens=t(seq),
                        extend_prefix_lens=t(prefix), extend_seq_lens=t(ext), req_to_token_pool=req_pool,
                        token_to_kv_pool=pool, seq_lens_cpu=seq, extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=ext)


class PagedRunner:
    """Runs our model on batches of requests, keeping each request's KV in the pool between calls."""

    def __init__(self, config, model, page_size: int, pool_tokens: int = 4096, max_reqs: int = 16,
                 kv_dtype: torch.dtype | None = None):
        self.model = model
        dtype = kv_dtype or next(model.parameters()).dtype
        self.kv_pool = MHATokenToKVPool(pool_tokens, page_size, dtype, config.num_layers,
                                        config.num_kv_heads, config.head_dim, "cpu")
        self.req_pool = ReqToTokenPool(max_reqs, 512, "cpu")
        self.slots = PagedSlots(pool_tokens, page_size)
        self.rows: dict[int, int] = {}  # request id -> req_to_token row
        self.lens: dict[int, int] = {}  # request id -> tokens in the pool

    def extend(self, new_tokens: dict[int, list[int]], all_logits: bool = True) -> torch.Tensor:
        return self._run(ForwardMode.EXTEND, new_tokens, all_logits)

    def decode(self, next_tokens: dict[int, int]) -> torch.Tensor:
        return self._run(ForwardMode.DECODE, {r: [t] for r, t in next_tokens.items()}, False)

    def _run(self, mode: ForwardMode, new_tokens: dict[int, list[int]], all_logits: bool) -> torch.Tensor:
        ids, positions, locs, rows, prefix, ext = [], [], [], [], [], []
        for rid, tokens in new_tokens.items():
            if rid not in self.rows:
                self.rows[rid], self.lens[rid] = self.req_pool.alloc(), 0
            row, start = self.rows[rid], self.lens[rid]
            locs.append(self.slots.slots_for(self.req_pool.req_to_token[row], start, len(tokens)))
            ids += tokens
            positions += range(start, start + len(tokens))
            rows.append(row)
            prefix.append(start)
            ext.append(len(tokens))
            self.lens[rid] = start + len(tokens)
        seq = [p + e for p, e in zip(prefix, ext)]
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        fb = ForwardBatch(
            mode=mode, batch_size=len(rows), input_ids=t(ids), positions=t(positions), out_cache_loc=torch.cat(locs),
            req_pool_indices=t(rows), seq_lens=t(seq), extend_prefix_lens=t(prefix), extend_seq_lens=t(ext),
            req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool, seq_lens_cpu=seq,
            extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=ext,
            logits_indices=torch.arange(len(ids)) if all_logits else None)
        self.model.attn_backend.init_forward_metadata(fb)
        return self.model(fb)


@pytest.fixture
def paged_runner():
    return PagedRunner


def assert_matches_torch_on_fp8_pool(backend, fb, pool, tokens, num_heads, kv_heads, head_dim, dtype, kv_dtype,
                                     scales, gen) -> None:
    """`backend` on an FP8 pool (or a 16-bit one under float32 queries) equals the torch backend reading the same
    pool (same bytes, same scales), for q/k/v of `tokens` new tokens whose k / scale spreads over FP8's range (|x| up
    to ~30) without saturating."""
    from tandem.common.model.attention.torch_backend import TorchAttentionBackend

    q = torch.randn(tokens, num_heads, head_dim, generator=gen).to(dtype)
    k = (torch.randn(tokens, kv_heads, head_dim, generator=gen) * 8 * scales[0]).to(dtype)
    v = (torch.randn(tokens, kv_heads, head_dim, generator=gen) * 8 * scales[1]).to(dtype)
    outputs = []
    for b in (TorchAttentionBackend("cpu"), backend):
        b.init_forward_metadata(fb)
        outputs.append(b.forward(q, k, v, 0, fb))
    expected, got = outputs
    assert got.dtype == dtype and pool.k_buffers[0].dtype == kv_dtype
    tol = (2e-5 if dtype == torch.float32 else 2e-2) * max(1.0, 8 * scales[1])  # outputs are about v's size
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def prefix_sharing_prompts(seed: int) -> list[list[int]]:
    """Mixed lengths, two sharing a 24-token prefix so the second extend starts from a prefix read from the pool."""
    import random

    rng = random.Random(seed)
    shared = [rng.randrange(8, 512) for _ in range(24)]
    return [[rng.randrange(8, 512) for _ in range(n)] for n in (1, 9, 37)] + [shared + [11, 12], shared + [13]]


def generate_prefix_sharing(model_dir: str, seed: int = 7, max_new: int = 6, **overrides):
    """Greedy runs of prefix_sharing_prompts(seed) on an Engine (small pool, 4-token pages, 16-token chunks): the
    first three as one batch, the prefix pair after, so the shared prefix is in the radix cache. Checks the pool is
    whole again after a cache flush; returns (sequences, engine stats, the KV pool)."""
    from tandem.common.config import EngineConfig
    from tandem.common.engine import Engine
    from tandem.common.sampling.params import SamplingParams
    from tandem.common.scheduler.io_struct import GenerateRequest

    config = EngineConfig(model_path=model_dir, max_total_tokens=1024, page_size=4, chunked_prefill_size=16,
                          **overrides)
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    with Engine(config) as engine:
        reqs = [GenerateRequest(f"r{i}", p, params, return_logprob=True)
                for i, p in enumerate(prefix_sharing_prompts(seed))]
        results = engine.generate(reqs[:3]) + engine.generate(reqs[3:4]) + engine.generate(reqs[4:])
        stats = engine.stats()
        pool = engine.kv_pool
        assert engine.flush_cache()
        memory = engine.memory_report()
    assert memory["free_tokens"] == memory["total_tokens"] and memory["leaked_tokens"] == 0, memory
    assert memory["free_req_slots"] == memory["total_req_slots"], memory
    assert stats["cache_hit_tokens"] >= 24  # the last extend attended a prefix read from the pool
    return [r.sequences[0] for r in results], stats, pool


def hf_logits_with_rounded_kv(model_dir: str, seqs: list[list[int]], roundings: dict) -> dict:
    """HF transformers' float32 eager logits of each sequence, once per entry of `roundings` (key -> None, or
    fn(layer, key, value) -> (key, value) applied to the [B, Hkv, L, D] K/V after RoPE, as a pool stores them)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    eager = modeling_llama.eager_attention_forward
    logits = {}
    for name, rounding in roundings.items():
        def rounded(module, query, key, value, *args, rounding=rounding, **kwargs):
            if rounding is not None:
                key, value = rounding(module.layer_idx, key, value)
            return eager(module, query, key, value, *args, **kwargs)

        modeling_llama.eager_attention_forward = rounded
        try:
            with torch.no_grad():
                logits[name] = [hf(torch.tensor([s])).logits[0] for s in seqs]
        finally:
            modeling_llama.eager_attention_forward = eager
    return logits


def extend_then_decode(runner: PagedRunner, seqs: list[list[int]], prompt_lens: list[int], steps: int) -> list:
    """Each sequence's logits from `runner`: its first prompt_lens[i] tokens in one extend, then `steps` decode
    steps feeding the sequence's next tokens; one [prompt_len + steps, vocab] tensor per sequence."""
    ours = list(runner.extend({i: s[:n] for i, (s, n) in enumerate(zip(seqs, prompt_lens))}).split(prompt_lens))
    for step in range(steps):
        decoded = runner.decode({i: s[n + step] for i, (s, n) in enumerate(zip(seqs, prompt_lens))})
        for i in range(len(seqs)):
            ours[i] = torch.cat([ours[i], decoded[i:i + 1]])
    return ours
