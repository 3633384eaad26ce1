"""Extend (prefill) attention in Triton: each new token attends its request's cached prefix, read from the
paged pool through req_to_token, then the request's new tokens causally, read from the contiguous k/v."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.common.model.attention.triton_kernels.decode import dot_in_f32, dot_precision, load_kv


@triton.jit
def _attend_block(q, k, v, valid, m_i, l_i, acc, sm_scale, PRECISION: tl.constexpr, DOT_IN_F32: tl.constexpr):
    """One online-softmax step of a [BLOCK_M, D] query block over a [BLOCK_N, D] key/value block."""
    if DOT_IN_F32:
        k, v = k.to(tl.float32), v.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
    scores = tl.where(valid, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _extend_kernel(Q, K_New, V_New, Out, K_Buf, V_Buf, Req_to_token, Req_pool_idx, Prefix_lens, Extend_lens,
                   Extend_starts, sm_scale, k_scale, v_scale, stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh,
                   stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh, stride_r2t,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_IN_F32: tl.constexpr,
                   KV_WIDEN: tl.constexpr):
    req = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    kv_head = head // GROUP
    extend_len = tl.load(Extend_lens + req).to(tl.int32)
    if m_block * BLOCK_M < extend_len:  # the grid is sized for the longest request
        prefix_len = tl.load(Prefix_lens + req).to(tl.int32)
        first = tl.load(Extend_starts + req).to(tl.int64)  # this request's first row in q/k/v/out
        row = tl.load(Req_pool_idx + req).to(tl.int64)
        m_offs = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        m_valid = m_offs < extend_len
        d_offs = tl.arange(0, BLOCK_D)
        d_mask = d_offs < HEAD_DIM
        q = tl.load(Q + (first + m_offs)[:, None] * stride_qt + head * stride_qh + d_offs[None, :],
                    mask=m_valid[:, None] & d_mask[None, :], other=0.0)
        if DOT_IN_F32:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(0, prefix_len, BLOCK_N):  # the cached prefix: every new token sees all of it
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = pos < prefix_len
            loc = tl.load(Req_to_token + row * stride_r2t + pos, mask=valid, other=0).to(tl.int64)
            kv_mask = valid[:, None] & d_mask[None, :]
            k = tl.load(K_Buf + loc[:, None] * stride_kt + kv_head * stride_kh + d_offs[None, :], mask=kv_mask,
                        other=0.0)
            v = tl.load(V_Buf + loc[:, None] * stride_vt + kv_head * stride_vh + d_offs[None, :], mask=kv_mask,
                        other=0.0)
            k, v = load_kv(k, k_scale, Q.dtype.element_ty, KV_WIDEN), load_kv(v, v_scale, Q.dtype.element_ty, KV_WIDEN)
            m_i, l_i, acc = _attend_block(q, k, v, valid[None, :], m_i, l_i, acc, sm_scale, PRECISION, DOT_IN_F32)
        # The new tokens, causally: this block's queries see keys up to their own position, none beyond.
        new_end = tl.minimum(extend_len, (m_block + 1) * BLOCK_M)
        for n0 in range(0, new_end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = pos < new_end
            kv_mask = valid[:, None] & d_mask[None, :]
            k = tl.load(K_New + (first + pos)[:, None] * stride_knt + kv_head * stride_knh + d_offs[None, :],
                        mask=kv_mask, other=0.0)
            v = tl.load(V_New + (first + pos)[:, None] * stride_vnt + kv_head * stride_vnh + d_offs[None, :],
                        mask=kv_mask, other=0.0)
            causal = valid[None, :] & (pos[None, :] <= m_offs[:, None])
            m_i, l_i, acc = _attend_block(q, k, v, causal, m_i, l_i, acc, sm_scale, PRECISION, DOT_IN_F32)
        out = acc / l_i[:, None]
        tl.store(Out + (first + m_offs)[:, None] * stride_ot + head * stride_oh + d_offs[None, :],
                 out.to(Out.dtype.element_ty), mask=m_valid[:, None] & d_mask[None, :])


def extend_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, out: torch.Tensor,
                     k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                     extend_starts: torch.Tensor, max_extend_len: int, block_m: int = 32, block_n: int = 32,
                     k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """out [T, Hq, D] for q [T, Hq, D] over each request's prefix (pool) and its new k_new/v_new [T, Hkv, D].

    Request b's new tokens are rows [extend_starts[b], extend_starts[b] + extend_lens[b]) of q, k_new, v_new
    and out; its prefix is req_to_token[req_pool_indices[b], :prefix_lens[b]]. Every tensor needs a unit
    stride on D; other strides are passed through (k_new/v_new may be views of a fused qkv projection).
    An FP8 pool is read as float(kv) * k_scale (v_scale) in q's dtype (a 16-bit one under float32 queries widened);
    k_new/v_new come in q's dtype.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_buf.shape[1]
    block_d = max(16, triton.next_power_of_2(head_dim))
    batch = req_pool_indices.shape[0]
    grid = (batch, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, k_new, v_new, out, k_buf, v_buf, req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_starts,
        head_dim ** -0.5, k_scale, v_scale, q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0),
        v_new.stride(1), out.stride(0), out.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0),
        v_buf.stride(1), req_to_token.stride(0), GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=dot_precision(q.dtype), DOT_IN_F32=dot_in_f32(q.dtype),
        KV_WIDEN=k_buf.dtype != q.dtype)
