"""Decode attention paths of the torch backend against a per-request, per-head reference."""

import pytest
import torch

from tandem.common.model.attention.torch_backend import _decode_attention


def reference(q, keys, values, lens):
    """softmax(q k^T / sqrt(d)) v for each request's first lens[b] keys, head by head, in float64."""
    batch, num_heads, head_dim = q.shape
    group = num_heads // keys.shape[2]
    out = torch.empty(batch, num_heads, head_dim, dtype=torch.float64)
    for b, n in enumerate(lens):
        for h in range(num_heads):
            k = keys[b, :n, h // group].double()
            v = values[b, :n, h // group].double()
            probs = torch.softmax(k @ q[b, h].double() / head_dim ** 0.5, dim=0)
            out[b, h] = probs @ v
    return out.view(batch, num_heads * head_dim)


@pytest.mark.parametrize("dtype,kv_heads,num_heads", [
    (torch.float32, 4, 8),    # SDPA on the strided gather
    (torch.float32, 2, 2),    # no GQA
    (torch.bfloat16, 4, 8),   # block-diagonal matmuls
    (torch.bfloat16, 1, 4),   # MQA, block-diagonal
    (torch.bfloat16, 8, 16),  # too many KV heads for block-diagonal: SDPA in float32
])
def test_decode_attention_matches_reference(dtype, kv_heads, num_heads):
    gen = torch.Generator().manual_seed(0)
    lens = [1, 7, 33, 50]
    batch, max_len, head_dim = len(lens), max(lens), 16
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)
    keys = torch.randn(batch, max_len, kv_heads, head_dim, generator=gen).to(dtype)
    values = torch.randn(batch, max_len, kv_heads, head_dim, generator=gen).to(dtype)
    # Padding rows hold garbage that the mask must hide.
    mask = (torch.arange(max_len)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
    keys = torch.where(mask.view(batch, max_len, 1, 1), keys, torch.full_like(keys, 50.0))
    out = _decode_attention(q, keys, values, mask)
    assert out.shape == (batch, num_heads * head_dim) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), reference(q, keys, values, lens), atol=tol, rtol=tol)
