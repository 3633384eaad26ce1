"""MHATokenToKVPool in FP8: what it writes, what a read gives back, its size, and the checkpoint's scales."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tandem.common.memory.kv_pool import MHATokenToKVPool, kv_bytes_per_token, kv_cache_dtype
from tandem.common.memory.kv_scales import pool_scales, read_kv_scales


def _pool(dtype, k_scales=None, v_scales=None, layers=2):
    return MHATokenToKVPool(64, 4, dtype, layers, 2, 8, k_scales=k_scales, v_scales=v_scales)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_round_trip_is_within_one_fp8_step(dtype):
    pool = _pool(dtype, k_scales=[0.02, 0.5], v_scales=[0.1, 1.0])
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    loc = torch.tensor([4, 5, 9, 12, 63])
    pool.set_kv_buffer(0, loc, k, v)
    k_buf, v_buf = pool.get_kv_buffer(0)
    assert k_buf.dtype == dtype
    # write = (k / scale) in FP8, read = float(kv) * scale
    assert torch.equal(k_buf[loc].view(torch.uint8), (k / 0.02).to(dtype).view(torch.uint8))
    k_read = pool.dequantize(k_buf[loc], 0.02, torch.float32)
    v_read = pool.dequantize(v_buf[loc], 0.1, torch.float32)
    mantissa_bits = 3 if dtype == torch.float8_e4m3fn else 2
    torch.testing.assert_close(k_read, k, rtol=2.0 ** -mantissa_bits, atol=0.02 * 2.0 ** -6)
    torch.testing.assert_close(v_read, v, rtol=2.0 ** -mantissa_bits, atol=0.1 * 2.0 ** -6)
    assert not torch.equal(k_read, k)  # it did quantize


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_values_past_the_range_saturate_instead_of_nan_or_inf(dtype):
    pool = _pool(dtype, k_scales=[1.0, 1.0], v_scales=[0.001, 1.0])
    big = torch.full((1, 2, 8), 1e6)
    big[0, 1] = -1e6
    pool.set_kv_buffer(0, torch.tensor([5]), big, big)
    limit = torch.finfo(dtype).max
    for buf in pool.get_kv_buffer(0):
        row = buf[5].float()
        assert row.isfinite().all()
        assert torch.equal(row[0], torch.full((8,), limit)) and torch.equal(row[1], torch.full((8,), -limit))


def test_fp8_pool_holds_one_byte_per_element():
    bf16, fp8 = _pool(torch.bfloat16), _pool(torch.float8_e4m3fn)
    assert fp8.total_bytes() * 2 == bf16.total_bytes() and fp8.page_bytes() * 2 == bf16.page_bytes()
    assert kv_bytes_per_token(2, 2, 8, torch.float8_e5m2) * 2 == kv_bytes_per_token(2, 2, 8, torch.bfloat16)
    assert fp8.k_buffers[0].element_size() == 1


def test_kv_cache_dtype_names():
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("fp8", torch.bfloat16) == kv_cache_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert kv_cache_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2


def test_scales_are_checked():
    with pytest.raises(ValueError, match="for an FP8 pool"):
        _pool(torch.bfloat16, k_scales=[1.0, 1.0])
    with pytest.raises(ValueError, match="1 entries for 2 layers"):
        _pool(torch.float8_e4m3fn, k_scales=[1.0])
    with pytest.raises(ValueError, match="finite and positive"):
        _pool(torch.float8_e4m3fn, v_scales=[1.0, 0.0])


def test_scales_come_from_the_checkpoint_by_vllm_names(tmp_path, caplog):
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.25),
               "model.layers.0.self_attn.v_scale": torch.tensor([0.5]),
               "model.layers.1.self_attn.kv_scale": torch.tensor(2.0),
               "model.embed_tokens.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    assert read_kv_scales(str(tmp_path), range(2)) == ([0.25, 2.0], [0.5, 2.0])
    assert read_kv_scales(str(tmp_path), range(1, 2)) == ([2.0], [2.0])  # a pipeline stage's layers
    with caplog.at_level("INFO", logger="tandem.common.memory.kv_scales"):
        scales = pool_scales(torch.float8_e4m3fn, "fp8", str(tmp_path), range(2))
    assert scales == {"k_scales": [0.25, 2.0], "v_scales": [0.5, 2.0]}
    assert "from the checkpoint" in caplog.text
    with pytest.raises(ValueError, match=r"none for layers \[2\]"):
        read_kv_scales(str(tmp_path), range(3))
    assert pool_scales(torch.bfloat16, "auto", str(tmp_path), range(2)) == {}  # auto ignores them


def test_a_checkpoint_without_scales_gives_one_and_says_so(tmp_path, caplog):
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with caplog.at_level("INFO", logger="tandem.common.memory.kv_scales"):
        assert pool_scales(torch.float8_e5m2, "fp8_e5m2", str(tmp_path), range(2)) == {}
    assert "scales 1.0" in caplog.text
    assert _pool(torch.float8_e5m2).k_scales == [1.0, 1.0]
