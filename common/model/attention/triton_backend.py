"""TritonAttentionBackend: paged attention in Triton kernels that read K/V straight from the pool (SGLang's design).

On CUDA the kernels compile natively. On CPU they run only under Triton's interpreter (TRITON_INTERPRET=1 set
before the kernels are imported), which executes each program with numpy on the CPU tensors themselves: a
correctness reference for the kernels, many times slower than the torch backend.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

from tandem.common.model.attention import triton_kernels
from tandem.common.model.attention.base import AttentionBackend
from tandem.common.model.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

# Split-K partitions of every decode request's KV: enough programs to fill a GPU at small batch; on CPU the
# interpreter runs programs one by one, so fewer is faster and two still exercise the merge.
CUDA_NUM_KV_SPLITS = 8
CPU_NUM_KV_SPLITS = 2


@dataclass
class TritonAttnMetadata:
    """One EXTEND batch's plan (DECODE needs none beyond ForwardBatch's own tensors, so a graph can replay it).

    extend_starts [B]: row of each request's first new token in the token-major q/k/v; max_extend_len sizes
    the grid.
    """

    extend_starts: torch.Tensor
    max_extend_len: int


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on `device` in this process, or None when they can."""
    if importlib.util.find_spec("triton") is None:
        return "--attention-backend triton needs the triton package (pip install triton)"
    if device.type == "cpu" and not triton_kernels.kernels_interpreted():
        return ("--attention-backend triton on CPU runs only under Triton's interpreter: set TRITON_INTERPRET=1 "
                "(a correctness mode, far slower than --attention-backend torch)")
    if device.type not in ("cpu", "cuda"):
        return f"--attention-backend triton runs on cuda (or cpu under TRITON_INTERPRET=1), not {device.type}"
    return None


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, device: torch.device | str | None = None, num_kv_splits: int | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        reason = triton_unavailable_reason(self.device)
        if reason:
            raise ValueError(reason)
        # optional: triton; and importing the kernels builds them (per TRITON_INTERPRET at that moment)
        from tandem.common.model.attention.triton_kernels.decode import decode_attention
        from tandem.common.model.attention.triton_kernels.extend import extend_attention

        if self.device.type == "cuda" and triton_kernels.kernels_interpreted():
            logger.warning("TRITON_INTERPRET=1 on CUDA: attention kernels run in the interpreter, not compiled")
        default_splits = CUDA_NUM_KV_SPLITS if self.device.type == "cuda" else CPU_NUM_KV_SPLITS
        self.num_kv_splits = num_kv_splits or default_splits
        self._decode_attention, self._extend_attention = decode_attention, extend_attention

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.is_decode:
            fb.attn_metadata = None
            return
        ext = fb.extend_seq_lens.to(fb.req_pool_indices.device)
        fb.attn_metadata = TritonAttnMetadata(torch.cumsum(ext, 0) - ext, max(fb.extend_seq_lens_cpu))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer_id)
        k_scale, v_scale = pool.k_scales[layer_id], pool.v_scales[layer_id]
        num_tokens, num_heads, head_dim = q.shape
        # tl.dot takes one dtype on both sides: the pool's, or the model's for a narrower pool (FP8, or 16-bit under
        # a float32 model: the kernels widen, and for FP8 scale, its tiles).
        dtype = pool.read_dtype(q.dtype)
        queries = _unit_stride(q.to(dtype))
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=dtype, device=q.device)
        req_to_token = fb.req_to_token_pool.req_to_token
        if fb.is_decode:
            self._decode_attention(queries, k_buf, v_buf, req_to_token, fb.req_pool_indices, fb.seq_lens, out,
                                   self.num_kv_splits, k_scale=k_scale, v_scale=v_scale)
        else:
            meta: TritonAttnMetadata = fb.attn_metadata
            if pool.quantized or k.dtype != k_buf.dtype:  # the new tokens as the pool holds them, rounded
                k, v = pool.as_stored(k, k_scale, dtype), pool.as_stored(v, v_scale, dtype)
            new_k, new_v = _unit_stride(k.to(dtype)), _unit_stride(v.to(dtype))
            self._extend_attention(queries, new_k, new_v, out, k_buf, v_buf, req_to_token, fb.req_pool_indices,
                                   fb.extend_prefix_lens, fb.extend_seq_lens, meta.extend_starts, meta.max_extend_len,
                                   k_scale=k_scale, v_scale=v_scale)
        return out.view(num_tokens, num_heads * head_dim).to(q.dtype)


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    """The kernels index the head dimension as contiguous; other strides (views of a fused qkv) are fine."""
    return x if x.stride(-1) == 1 else x.contiguous()
