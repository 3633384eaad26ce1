"""TorchAttentionBackend: batched paged attention with torch SDPA, for CPU or any device."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.common.model.attention.base import AttentionBackend
from tandem.common.model.forward_batch import ForwardBatch


@dataclass
class TorchAttnMetadata:
    """One batch's plan, shared by every layer.

    kv_indices [B, L]: KV pool rows of each request's sequence, padded with 0 (the padding page).
    mask [B, 1, Q, L]: True where query row q of request b may attend key l; None for a lone request
    without a cached prefix, which runs SDPA's plain causal path (no [Q, L] mask in memory).
    token_rows [T] (EXTEND only): row of each new token in the padded [B * Q] query layout;
    None when no padding is needed (DECODE, or a single request).
    own_kv (EXTEND only): no request has a cached prefix, so every key is one of the batch's new tokens and
    attention reads k/v as computed instead of gathering them back from the pool.
    """

    kv_indices: torch.Tensor
    mask: torch.Tensor | None
    max_extend_len: int
    token_rows: torch.Tensor | None
    own_kv: bool = False


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else None

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        device = fb.req_pool_indices.device
        seq_lens_list = fb.seq_lens_cpu  # the CPU copies ScheduleBatch fills: planning never syncs the device
        max_len = max(seq_lens_list)
        seq_lens = fb.seq_lens.to(device)
        key_pos = torch.arange(max_len, device=device)
        valid = key_pos[None, :] < seq_lens[:, None]  # [B, L]
        rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_len]
        kv_indices = torch.where(valid, rows, torch.zeros_like(rows))
        if fb.is_decode:
            fb.attn_metadata = TorchAttnMetadata(kv_indices, valid[:, None, None, :], 1, None)
            return
        ext_list = fb.extend_seq_lens_cpu
        max_ext = max(ext_list)
        prefix_list = fb.extend_prefix_lens_cpu
        if fb.batch_size == 1 and prefix_list[0] == 0:
            fb.attn_metadata = TorchAttnMetadata(kv_indices, None, max_ext, None, own_kv=True)
            return
        prefix_lens = fb.extend_prefix_lens.to(device)
        q_idx = torch.arange(max_ext, device=device)
        # Key l is visible to new token j of request b iff l <= prefix_len[b] + j (and l < seq_len[b]).
        # Padded query rows (j >= extend_len) still see key 0, so no row is fully masked (no NaN).
        causal = key_pos[None, None, :] <= (prefix_lens[:, None, None] + q_idx[None, :, None])
        mask = (causal & valid[:, None, :])[:, None]  # [B, 1, Q, L]
        token_rows = None
        if fb.batch_size > 1 and any(n != max_ext for n in ext_list):
            ext = torch.tensor(ext_list, device=device)
            starts = torch.arange(fb.batch_size, device=device) * max_ext
            req_of_token = torch.repeat_interleave(torch.arange(fb.batch_size, device=device), ext)
            offsets = torch.cumsum(ext, 0) - ext
            token_rows = starts[req_of_token] + torch.arange(int(ext.sum()), device=device) - offsets[req_of_token]
        own_kv = not any(prefix_list)
        fb.attn_metadata = TorchAttnMetadata(kv_indices, mask, max_ext, token_rows, own_kv)

    def replay_graph_metadata(self, static: ForwardBatch, fb: ForwardBatch) -> None:
        """The graph was captured on a plan for the whole context ([B, max_context_len] indices and mask): the
        batch's shorter plan is copied into its head, the rest masked out."""
        meta, planned = static.attn_metadata, fb.attn_metadata
        length = planned.kv_indices.shape[1]
        meta.kv_indices.zero_()
        meta.kv_indices[:, :length].copy_(planned.kv_indices)
        meta.mask.zero_()
        meta.mask[..., :length].copy_(planned.mask)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer_id, fb.out_cache_loc, k, v)
        meta: TorchAttnMetadata = fb.attn_metadata
        k_buf, v_buf = pool.get_kv_buffer(layer_id)
        k_scale, v_scale = pool.k_scales[layer_id], pool.v_scales[layer_id]
        # An FP8 pool is read as float(kv) * scale in the model's dtype, a 16-bit one under a float32 model widened
        # to float32; any other pool in its own dtype.
        dtype = pool.read_dtype(q.dtype)
        batch, kv_len = meta.kv_indices.shape
        if not fb.is_decode and meta.own_kv:
            # No cached prefix: the keys are this batch's own k/v (as the pool holds them: rounded through FP8 or 16
            # bits in a narrower pool), laid out like the queries; no gather from the pool.
            # contiguous: the same memory layout as the gathered rows, so the same kernels and the same numbers.
            if pool.quantized or k.dtype != k_buf.dtype:
                k, v = pool.as_stored(k, k_scale, dtype), pool.as_stored(v, v_scale, dtype)
            keys = _padded_rows(k.to(dtype), meta.token_rows, batch * kv_len).contiguous()
            values = _padded_rows(v.to(dtype), meta.token_rows, batch * kv_len).contiguous()
            keys, values = keys.view(batch, kv_len, *k.shape[1:]), values.view(batch, kv_len, *v.shape[1:])
        else:
            # index_select of whole rows, then views: [B, L, Hkv, D] with no further copy.
            flat = meta.kv_indices.reshape(-1)
            keys = k_buf.index_select(0, flat).view(batch, kv_len, *k_buf.shape[1:])
            values = v_buf.index_select(0, flat).view(batch, kv_len, *v_buf.shape[1:])
            if pool.quantized or dtype != k_buf.dtype:
                keys, values = pool.dequantize(keys, k_scale, dtype), pool.dequantize(values, v_scale, dtype)
        if fb.is_decode:
            return _decode_attention(q, keys, values, meta.mask)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hkv, L, D]
        num_tokens, num_heads, head_dim = q.shape
        q_len = meta.max_extend_len
        q = _padded_rows(q, meta.token_rows, batch * q_len)
        queries = q.view(batch, q_len, num_heads, head_dim).transpose(1, 2).to(keys.dtype)  # [B, Hq, Q, D]
        if meta.mask is not None and _use_matmul_attention(queries, keys):
            out = _matmul_attention(queries, keys, values, meta.mask)
        else:
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.mask,
                                                 is_causal=meta.mask is None, enable_gqa=num_heads != keys.shape[1])
        out = out.transpose(1, 2).reshape(batch * q_len, num_heads * head_dim)
        if meta.token_rows is not None:
            out = out[meta.token_rows]
        return out.to(q.dtype)


def _padded_rows(x: torch.Tensor, token_rows: torch.Tensor | None, rows: int) -> torch.Tensor:
    """x [T, ...] placed at token_rows of a zero [rows, ...] tensor (the padded per-request layout); x itself when
    no padding is needed."""
    if token_rows is None:
        return x
    padded = x.new_zeros(rows, *x.shape[1:])
    padded[token_rows] = x
    return padded


# Decode in reduced precision folds the KV heads into one matmul when there are at most this many of them.
_BLOCK_DIAGONAL_MAX_KV_HEADS = 4


def _decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One query row per request; keys/values [B, L, Hkv, D] straight from the gather (not transposed).

    float32: SDPA's CPU kernel reads the strided [B, Hkv, L, D] views as they are. bfloat16/float16 (where that
    kernel is several times slower): with few KV heads, a block-diagonal query matrix turns the per-head products
    into two plain batched matmuls over the gathered rows; with many, SDPA in float32."""
    batch, num_heads, head_dim = q.shape
    kv_heads = keys.shape[2]
    if keys.dtype != torch.float32 and kv_heads <= _BLOCK_DIAGONAL_MAX_KV_HEADS:
        return _block_diagonal_decode(q.to(keys.dtype), keys, values, mask).to(q.dtype)
    dtype = torch.float32
    queries = q.view(batch, num_heads, 1, head_dim).to(dtype)
    out = F.scaled_dot_product_attention(queries, keys.transpose(1, 2).to(dtype), values.transpose(1, 2).to(dtype),
                                         attn_mask=mask, enable_gqa=num_heads != kv_heads)
    return out.view(batch, num_heads * head_dim).to(q.dtype)


def _block_diagonal_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           mask: torch.Tensor) -> torch.Tensor:
    """Row (h, g) of the query matrix holds query head h*G+g in KV head h's block and zeros elsewhere, so
    q_bd @ K^T over all Hkv*D columns gives each head's scores against its own KV head only; the output's
    diagonal blocks are each head's result. Costs Hkv times the (small) attention FLOPs, saves every copy."""
    batch, num_heads, head_dim = q.shape
    kv_len, kv_heads = keys.shape[1], keys.shape[2]
    group = num_heads // kv_heads
    eye = torch.eye(kv_heads, dtype=q.dtype, device=q.device).view(1, kv_heads, 1, kv_heads, 1)
    q_bd = (q.view(batch, kv_heads, group, 1, head_dim) * eye).reshape(batch, num_heads, kv_heads * head_dim)
    scores = torch.bmm(q_bd, keys.view(batch, kv_len, -1).transpose(1, 2)).float() * (head_dim ** -0.5)
    scores = scores.masked_fill(~mask.view(batch, 1, kv_len), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.bmm(probs, values.view(batch, kv_len, -1)).view(batch, kv_heads, group, kv_heads, head_dim)
    return torch.diagonal(out, dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(batch, num_heads * head_dim)


# Above this many score elements the explicit [B, Hkv, G*Q, L] score tensor costs too much memory.
_MATMUL_ATTENTION_MAX_SCORES = 1 << 25


def _use_matmul_attention(queries: torch.Tensor, keys: torch.Tensor) -> bool:
    """Reduced-precision extend when the score tensor stays small (CPU's bf16 SDPA is several times slower)."""
    batch, heads, q_len, _ = queries.shape
    return queries.dtype != torch.float32 and batch * heads * q_len * keys.shape[2] <= _MATMUL_ATTENTION_MAX_SCORES


def _matmul_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v with GQA by grouping query heads per KV head; softmax in float32."""
    batch, num_heads, q_len, head_dim = queries.shape
    kv_heads, kv_len = keys.shape[1], keys.shape[2]
    group = num_heads // kv_heads
    grouped = queries.reshape(batch, kv_heads, group * q_len, head_dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * (head_dim ** -0.5)
    scores = scores.view(batch, kv_heads, group, q_len, kv_len)
    scores = scores.masked_fill(~mask.view(batch, 1, 1, mask.shape[-2], kv_len), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype).view(batch, kv_heads, group * q_len, kv_len)
    out = torch.matmul(probs, values)  # [B, Hkv, G*Q, D]
    return out.view(batch, num_heads, q_len, head_dim)
