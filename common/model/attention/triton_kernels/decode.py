"""Paged decode attention in two Triton stages: split-K partials over the pool, then a log-sum-exp merge.

Stage 1 runs one program per (request, KV head, split): it reads its slice of the request's KV straight
from the pool through req_to_token (no gathered [B, L] copy) and attends all query heads of that KV head
at once (GQA as one [heads, BLOCK_N] dot). Stage 2 merges the splits of each (request, query head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.common.model.attention.triton_kernels import kernels_interpreted


@triton.jit
def load_kv(x, scale, dtype, KV_WIDEN: tl.constexpr):
    """A tile read from the pool, in the queries' dtype: a narrower pool's values (FP8, or 16-bit under float32
    queries) widened to float32 and scaled (1.0 for 16-bit)."""
    if KV_WIDEN:
        x = (x.to(tl.float32) * scale).to(dtype)
    return x


@triton.jit
def _decode_stage1(Q, K_Buf, V_Buf, Req_to_token, Req_pool_idx, Seq_lens, Mid_O, Mid_Lse, sm_scale, k_scale, v_scale,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_r2t,
                   stride_mo_b, stride_mo_h, stride_mo_s,
                   NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
                   DOT_IN_F32: tl.constexpr, KV_WIDEN: tl.constexpr):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    h_offs = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + h_offs
    h_mask = h_offs < GROUP
    d_offs = tl.arange(0, BLOCK_D)
    d_mask = d_offs < HEAD_DIM

    seq_len = tl.load(Seq_lens + req).to(tl.int32)
    row = tl.load(Req_pool_idx + req).to(tl.int64)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if end > start:
        q = tl.load(Q + req * stride_qt + heads[:, None] * stride_qh + d_offs[None, :],
                    mask=h_mask[:, None] & d_mask[None, :], other=0.0)
        if DOT_IN_F32:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = pos < end
            loc = tl.load(Req_to_token + row * stride_r2t + pos, mask=valid, other=0).to(tl.int64)
            kv_mask = valid[:, None] & d_mask[None, :]
            k = tl.load(K_Buf + loc[:, None] * stride_kt + kv_head * stride_kh + d_offs[None, :], mask=kv_mask,
                        other=0.0)
            k = load_kv(k, k_scale, q.dtype, KV_WIDEN)
            if DOT_IN_F32:
                k = k.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale  # [BLOCK_H, BLOCK_N]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V_Buf + loc[:, None] * stride_vt + kv_head * stride_vh + d_offs[None, :], mask=kv_mask,
                        other=0.0)
            v = load_kv(v, v_scale, q.dtype, KV_WIDEN)
            if DOT_IN_F32:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = Mid_O + req * stride_mo_b + heads[:, None] * stride_mo_h + split * stride_mo_s + d_offs[None, :]
        tl.store(out, acc / l_i[:, None], mask=h_mask[:, None] & d_mask[None, :])
        tl.store(Mid_Lse + (req * NUM_HEADS + heads) * NUM_SPLITS + split, m_i + tl.log(l_i), mask=h_mask)


@triton.jit
def _decode_stage2(Mid_O, Mid_Lse, Seq_lens, Out, stride_mo_b, stride_mo_h, stride_mo_s, stride_ot, stride_oh,
                   NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   NUM_SPLITS: tl.constexpr):
    req = tl.program_id(0)
    head = tl.program_id(1)
    d_offs = tl.arange(0, BLOCK_D)
    d_mask = d_offs < HEAD_DIM
    seq_len = tl.load(Seq_lens + req).to(tl.int32)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for split in range(NUM_SPLITS):
        if split * split_len < seq_len:  # later splits of a short request did no work
            lse = tl.load(Mid_Lse + (req * NUM_HEADS + head) * NUM_SPLITS + split)
            part = tl.load(Mid_O + req * stride_mo_b + head * stride_mo_h + split * stride_mo_s + d_offs,
                           mask=d_mask, other=0.0)
            m_new = tl.maximum(m_i, lse)
            alpha = tl.exp(m_i - m_new)
            weight = tl.exp(lse - m_new)
            acc = acc * alpha + part * weight
            l_i = l_i * alpha + weight
            m_i = m_new
    # A padding row (seq_len 0, as a graph's bucket padding may pass) has no split: write zeros, not 0/0.
    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    tl.store(Out + req * stride_ot + head * stride_oh + d_offs, (acc / l_i).to(Out.dtype.element_ty), mask=d_mask)


def dot_precision(dtype: torch.dtype) -> str | None:
    """float32 stays IEEE (TF32 on CUDA would cost greedy parity with the torch backend); None (Triton's default)
    for 16-bit inputs, where the choice does not apply."""
    return "ieee" if dtype == torch.float32 else None


def dot_in_f32(dtype: torch.dtype) -> bool:
    """Triton's interpreter (3.x) runs tl.dot as np.matmul on bfloat16's raw uint16 storage, which is garbage,
    so interpreted bfloat16 tiles are widened to float32 first; compiled kernels keep the native bf16 dot."""
    return dtype == torch.bfloat16 and kernels_interpreted()


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                     num_kv_splits: int, block_n: int = 32, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """out[b] = attention of q[b] [Hq, D] over req_to_token[req_pool_indices[b], :seq_lens[b]] in the pool.

    An FP8 pool (k_buf/v_buf float8_e4m3fn or float8_e5m2) is read as float(kv) * k_scale (v_scale) in q's dtype,
    a 16-bit one under float32 queries widened to float32.

    q/out [B, Hq, D] and k_buf/v_buf [rows, Hkv, D] need a unit stride on D; any other strides are passed
    through. num_kv_splits is fixed per call (not derived from the lengths) so a captured graph replays it.
    """
    batch, num_heads, head_dim = q.shape
    kv_heads = k_buf.shape[1]
    group = num_heads // kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_h = max(16, triton.next_power_of_2(group))  # tl.dot wants every side >= 16
    mid_out = torch.empty(batch, num_heads, num_kv_splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, num_heads, num_kv_splits, dtype=torch.float32, device=q.device)
    precision = dot_precision(q.dtype)
    _decode_stage1[(batch, kv_heads, num_kv_splits)](
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, mid_out, mid_lse, head_dim ** -0.5, k_scale, v_scale,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0), mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_N=block_n,
        NUM_SPLITS=num_kv_splits, PRECISION=precision, DOT_IN_F32=dot_in_f32(q.dtype),
        KV_WIDEN=k_buf.dtype != q.dtype)
    _decode_stage2[(batch, num_heads)](
        mid_out, mid_lse, seq_lens, out, mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        NUM_SPLITS=num_kv_splits)
