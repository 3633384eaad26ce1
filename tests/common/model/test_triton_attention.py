"""The Triton attention kernels, run by Triton's interpreter on CPU, against the torch backend layer by layer."""

from __future__ import annotations

import os

import pytest

# @triton.jit picks the interpreter when the kernel module is imported, so this precedes every import of it.
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import torch  # noqa: E402

from tandem.common.memory.kv_pool import MHATokenToKVPool  # noqa: E402
from tandem.common.memory.req_to_token import ReqToTokenPool  # noqa: E402
from tandem.common.model.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from tandem.common.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from tandem.common.model.forward_batch import ForwardMode  # noqa: E402
from tests.common.model.conftest import assert_matches_torch_on_fp8_pool, paged_forward_batch  # noqa: E402


def _compare(mode, prefix, ext, page_size, num_heads, kv_heads, head_dim, dtype, num_kv_splits=None):
    gen = torch.Generator().manual_seed(sum(prefix) * 31 + sum(ext))
    pool = MHATokenToKVPool(512, page_size, dtype, 1, kv_heads, head_dim)
    req_pool = ReqToTokenPool(len(prefix), 256)
    fb = paged_forward_batch(mode, prefix, ext, page_size, pool, req_pool, gen)
    tokens = sum(ext)
    q = torch.randn(tokens, num_heads, head_dim, generator=gen).to(dtype)
    # k/v as the model hands them over: strided views of one fused projection.
    kv = torch.randn(tokens, 2 * kv_heads * head_dim, generator=gen).to(dtype)
    k = kv[:, :kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = kv[:, kv_heads * head_dim:].view(tokens, kv_heads, head_dim)
    outputs = []
    for backend in (TorchAttentionBackend("cpu"), TritonAttentionBackend("cpu", num_kv_splits=num_kv_splits)):
        backend.init_forward_metadata(fb)
        outputs.append(backend.forward(q, k, v, 0, fb))
    expected, got = outputs
    assert got.shape == (tokens, num_heads * head_dim) and got.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("page_size,num_heads,kv_heads,head_dim,dtype,splits", [
    (1, 4, 4, 16, torch.float32, 2),      # MHA, page size 1
    (4, 8, 2, 24, torch.float32, 4),      # GQA 4, a head dim that is not a power of two, empty splits
    (16, 4, 1, 32, torch.bfloat16, 3),    # MQA in bfloat16
    (8, 32, 2, 16, torch.float32, 1),     # group of 16 heads: a full tl.dot tile, no split
    (16, 8, 4, 64, torch.bfloat16, 8),    # the small preset's head dim, more splits than short requests fill
])
def test_decode_matches_torch_backend(page_size, num_heads, kv_heads, head_dim, dtype, splits):
    lens = [1, 5, 40, 17]  # sequence lengths after this step, mixed in one batch
    _compare(ForwardMode.DECODE, [n - 1 for n in lens], [1] * len(lens), page_size, num_heads, kv_heads, head_dim,
             dtype, splits)


@pytest.mark.parametrize("page_size,num_heads,kv_heads,head_dim,dtype,prefix,ext", [
    (1, 4, 4, 16, torch.float32, [0], [37]),                 # plain prefill over two query blocks
    (4, 8, 2, 24, torch.float32, [0, 9, 33], [5, 40, 1]),    # mixed prefixes and lengths, GQA
    (16, 4, 1, 32, torch.bfloat16, [20, 0], [3, 16]),        # MQA in bfloat16, prefix across pages
    (2, 6, 3, 8, torch.float16, [3, 1], [2, 7]),             # float16, head dim 8 padded to a 16 tile
    (8, 4, 2, 16, torch.float32, [64], [8]),                 # a long cached prefix, a short chunk
    (16, 4, 2, 128, torch.float32, [5], [20]),               # head dim 128 (Qwen3's small preset)
])
def test_extend_matches_torch_backend(page_size, num_heads, kv_heads, head_dim, dtype, prefix, ext):
    _compare(ForwardMode.EXTEND, prefix, ext, page_size, num_heads, kv_heads, head_dim, dtype)


def test_decode_padding_row_without_kv_gives_zeros():
    """A graph bucket may pad the batch with rows of seq_len 0: their output is 0, not NaN, and real rows hold."""
    from tandem.common.model.attention.triton_kernels.decode import decode_attention

    gen = torch.Generator().manual_seed(3)
    k_buf, v_buf = torch.randn(2, 32, 2, 16, generator=gen)
    req_to_token = torch.arange(64).view(2, 32)
    q = torch.randn(2, 4, 16, generator=gen)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k_buf, v_buf, req_to_token, torch.tensor([0, 1]), torch.tensor([5, 0]), out, num_kv_splits=2)
    assert torch.equal(out[1], torch.zeros(4, 16))
    keys, values = k_buf[:5].repeat_interleave(2, dim=1), v_buf[:5].repeat_interleave(2, dim=1)  # GQA 2
    probs = torch.softmax(torch.einsum("hd,lhd->hl", q[0], keys) / 4.0, dim=-1)
    torch.testing.assert_close(out[0], torch.einsum("hl,lhd->hd", probs, values), atol=2e-5, rtol=2e-5)


def test_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    from tandem.common.model.attention import triton_kernels

    monkeypatch.setattr(triton_kernels, "kernels_interpreted", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        TritonAttentionBackend("cpu")


def _compare_fp8(mode, prefix, ext, kv_dtype, dtype, scales):
    """The kernels on an FP8 pool against the torch backend reading the same pool (same bytes, same scales)."""
    page_size, num_heads, kv_heads, head_dim = 4, 8, 2, 32
    gen = torch.Generator().manual_seed(sum(prefix) * 7 + sum(ext))
    scaled = {"k_scales": [scales[0]], "v_scales": [scales[1]]} if kv_dtype.itemsize == 1 else {}
    pool = MHATokenToKVPool(512, page_size, kv_dtype, 1, kv_heads, head_dim, **scaled)
    fb = paged_forward_batch(mode, prefix, ext, page_size, pool, ReqToTokenPool(len(prefix), 256), gen)
    assert_matches_torch_on_fp8_pool(TritonAttentionBackend("cpu", num_kv_splits=2), fb, pool, sum(ext), num_heads, kv_heads, head_dim, dtype,
                                     kv_dtype, scales, gen)


@pytest.mark.parametrize("kv_dtype,dtype,scales", [
    (torch.float8_e4m3fn, torch.float32, (1.0, 1.0)),
    (torch.float8_e4m3fn, torch.bfloat16, (0.05, 0.1)),
    (torch.float8_e5m2, torch.float32, (0.5, 2.0)),
    (torch.bfloat16, torch.float32, (1.0, 1.0)),  # --kv-cache-dtype bfloat16 under a float32 model: tiles widened
    (torch.float16, torch.float32, (1.0, 1.0)),
])
def test_fp8_pool_matches_torch_backend(kv_dtype, dtype, scales):
    _compare_fp8(ForwardMode.DECODE, [0, 4, 39, 16], [1, 1, 1, 1], kv_dtype, dtype, scales)
    _compare_fp8(ForwardMode.EXTEND, [0, 9, 33], [5, 40, 1], kv_dtype, dtype, scales)
