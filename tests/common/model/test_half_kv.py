"""--kv-cache-dtype bfloat16/float16 under a float32 model: the pool holds K/V rounded to 16 bits and attention runs
in float32 over them. Against HF transformers given the same rounding of its cache, every CPU-testable backend's
greedy run against the torch backend's on the same cache (both loops), the refusal of a 16-bit cache under a 16-bit
model of the other kind, and the pool's capacity."""

from __future__ import annotations

import os

import pytest

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports the kernels (see test_triton_attention)

import torch  # noqa: E402

from tandem.common import engine as engine_module  # noqa: E402
from tandem.common.config import EngineConfig  # noqa: E402
from tandem.common.engine import kv_pool_tokens  # noqa: E402
from tandem.common.flags import ConfigError  # noqa: E402
from tandem.common.memory.kv_pool import kv_bytes_per_token, kv_cache_dtype  # noqa: E402
from tandem.common.model.loader import load_model  # noqa: E402
from tests.common.model.conftest import (PagedRunner, extend_then_decode, generate_prefix_sharing,  # noqa: E402
                                         hf_logits_with_rounded_kv)

PROMPT_LENS = [7, 13, 1, 22]
DECODE_STEPS = 3
HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """(token lists, HF float32 logits with its K/V rounded through each 16-bit dtype, HF logits unrounded)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_llama).vocab_size
    gen = torch.Generator().manual_seed(11)
    seqs = [torch.randint(5, vocab, (n + DECODE_STEPS,), generator=gen).tolist() for n in PROMPT_LENS]

    def through(kv_dtype):
        return lambda layer, key, value: (key.to(kv_dtype).float(), value.to(kv_dtype).float())

    return seqs, hf_logits_with_rounded_kv(tiny_llama, seqs, {None: None, torch.bfloat16: through(torch.bfloat16),
                                                              torch.float16: through(torch.float16)})


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_a_16bit_cache_matches_hf_with_the_same_rounding(tiny_llama, reference, backend, kv_dtype):
    seqs, hf_logits = reference
    config, model = load_model(tiny_llama, "float32", "cpu", backend)
    runner = PagedRunner(config, model, page_size=4, kv_dtype=kv_dtype)
    assert runner.kv_pool.k_buffers[0].dtype == kv_dtype
    ours = extend_then_decode(runner, seqs, PROMPT_LENS, DECODE_STEPS)
    for mine, ref, plain in zip(ours, hf_logits[kv_dtype], hf_logits[None]):
        assert mine.dtype == torch.float32
        ref, plain = ref[: mine.shape[0]], plain[: mine.shape[0]]
        gap = (ref - plain).abs().max().item()  # how far rounding HF's cache through kv_dtype moves its logits
        # Float32 attention over the same rounded K/V: the torch backend to float32 noise. The cpu backend's RMSNorm
        # sums its squares in another order than torch's, and a K an ulp apart can round to the neighbouring
        # float16 value, so there the bound is a third of the rounding's own effect.
        limit = 1e-4 if backend == "torch" else max(1e-4, gap / 3)
        assert (mine - ref).abs().max().item() < limit
        assert (mine - plain).abs().max().item() > 1e-5  # and the cache really is 16-bit


def _generate(model_dir: str, **overrides):
    sequences, _, pool = generate_prefix_sharing(model_dir, seed=7, dtype="float32", **overrides)
    return sequences, pool


@pytest.fixture(scope="module")
def torch_bf16_reference(tiny_llama):
    return _generate(tiny_llama, attention_backend="torch", event_loop="normal", kv_cache_dtype="bfloat16")[0]


@pytest.mark.parametrize("backend,event_loop", [("cpu", "normal"), ("cpu", "overlap"), ("triton", "overlap")])
def test_greedy_on_a_bf16_cache_matches_torch_backend_on_it(tiny_llama, torch_bf16_reference, backend, event_loop):
    got, pool = _generate(tiny_llama, attention_backend=backend, event_loop=event_loop, kv_cache_dtype="bf16")
    assert pool.k_buffers[0].dtype == torch.bfloat16 and not pool.quantized
    for seq, ref in zip(got, torch_bf16_reference):
        assert seq.output_ids == ref.output_ids
        assert max(abs(a - b) for a, b in zip(seq.logprobs, ref.logprobs)) < 1e-4


def test_a_16bit_cache_changes_the_numbers_but_stays_close_to_float32(tiny_llama, torch_bf16_reference):
    full = _generate(tiny_llama, attention_backend="torch", event_loop="normal")[0]
    first_logprobs = [(a.logprobs[0], b.logprobs[0]) for a, b in zip(torch_bf16_reference, full)]
    assert any(a != b for a, b in first_logprobs)  # the cache really is bf16
    assert all(abs(a - b) < 0.02 for a, b in first_logprobs)


def test_float16_cache_runs_on_the_cpu_backend(tiny_llama):
    got, pool = _generate(tiny_llama, attention_backend="cpu", event_loop="overlap", kv_cache_dtype="fp16")
    reference = _generate(tiny_llama, attention_backend="torch", event_loop="normal", kv_cache_dtype="float16")[0]
    assert pool.k_buffers[0].dtype == torch.float16
    assert [s.output_ids for s in got] == [s.output_ids for s in reference]


def test_a_16bit_cache_is_for_a_float32_model(tiny_llama):
    assert kv_cache_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert kv_cache_dtype("fp16", torch.float32) == torch.float16
    assert kv_cache_dtype("bf16", torch.bfloat16) == torch.bfloat16  # the model's own: allowed, the same as auto
    with pytest.raises(ConfigError, match="--kv-cache-dtype float16 under a bfloat16 model"):
        kv_cache_dtype("float16", torch.bfloat16)
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be one of auto, bfloat16, bf16, float16, fp16"):
        EngineConfig(model_path=tiny_llama, kv_cache_dtype="half").validate()


def test_a_16bit_pool_holds_twice_the_tokens_of_a_float32_one(tiny_llama, monkeypatch):
    monkeypatch.setattr(engine_module, "_available_ram", lambda: 1 << 24)
    config = EngineConfig(model_path=tiny_llama, page_size=4, mem_fraction=0.5)
    f32 = kv_pool_tokens(config, kv_bytes_per_token(4, 2, 64, torch.float32), 1 << 20)
    bf16 = kv_pool_tokens(config, kv_bytes_per_token(4, 2, 64, HALF["bfloat16"]), 1 << 20)
    assert bf16 == 2 * f32
