"""An FP8 KV cache against HF transformers given the same cache: HF's eager attention with its K/V rounded as
the pool stores them (k / k_scale in FP8, read back times k_scale). Our extend and decode logits must match it,
and differ from the unquantized HF logits (the cache really is FP8)."""

from __future__ import annotations

import pytest
import torch

from tandem.common.model.loader import load_model
from tests.common.model.conftest import PagedRunner, extend_then_decode, hf_logits_with_rounded_kv

PROMPT_LENS = [7, 13, 1, 22]
DECODE_STEPS = 3
K_SCALES, V_SCALES = [0.05, 0.2], [0.1, 0.02]  # per layer, the tiny model has 2


def _fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype).float().mul(scale).to(x.dtype)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """(token lists, HF logits with the cache rounded through each FP8 format, HF logits unrounded)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_llama).vocab_size
    assert AutoConfig.from_pretrained(tiny_llama).num_hidden_layers == len(K_SCALES)
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(5, vocab, (n + DECODE_STEPS,), generator=gen).tolist() for n in PROMPT_LENS]

    def through(kv_dtype):
        return lambda layer, key, value: (_fp8(key, K_SCALES[layer], kv_dtype), _fp8(value, V_SCALES[layer], kv_dtype))

    return seqs, hf_logits_with_rounded_kv(tiny_llama, seqs, {None: None, torch.float8_e4m3fn: through(
        torch.float8_e4m3fn), torch.float8_e5m2: through(torch.float8_e5m2)})


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_matches_hf_with_the_same_rounding(tiny_llama, reference, backend, kv_dtype):
    seqs, hf_logits = reference
    config, model = load_model(tiny_llama, "float32", "cpu", backend)
    runner = PagedRunner(config, model, page_size=4, kv_dtype=kv_dtype)
    runner.kv_pool.k_scales, runner.kv_pool.v_scales = list(K_SCALES), list(V_SCALES)
    ours = extend_then_decode(runner, seqs, PROMPT_LENS, DECODE_STEPS)
    for mine, ref, plain in zip(ours, hf_logits[kv_dtype], hf_logits[None]):
        ref, plain = ref[: mine.shape[0]], plain[: mine.shape[0]]
        # A K/V element within float32 noise of an FP8 rounding boundary may round the other way than HF's:
        # rare, and one FP8 step then moves a logit by far less than 1e-3.
        assert (mine - ref).abs().max().item() < 1e-3
        assert (mine - plain).abs().max().item() > 1e-2
