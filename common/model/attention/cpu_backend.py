"""CpuAttentionBackend: paged attention in compiled C++ ops that read K/V straight from the pool (no gathers, no masks).

The ops (common/model/attention/cpu/paged_attention.cpp, built on first use) take the pool buffers, req_to_token
and the batch's length tensors as they are: decode attends each request's one query row over
req_to_token[row, :seq_len] with all query heads of a KV head together (GQA) and split-K when the batch is too
small to fill the threads; extend walks each new token's keys [0, its position] (cached prefix and new tokens alike,
both already in the pool) causally, so no dense [B, 1, Q, L] mask exists. Both accumulate in float32, in explicit
AVX-512 kernels where the CPU has them, else AVX2 (+FMA, F16C) ones (chosen at run time and logged), and in portable
loops elsewhere. An FP8 pool is read
as float(kv) with the layer's k_scale folded into the softmax scale and v_scale into the output's normalization; a
16-bit pool under a float32 model (--kv-cache-dtype bfloat16/float16) as float(kv) with float32 queries.
"""

from __future__ import annotations

import logging

import torch

from tandem.common.model.attention.base import AttentionBackend
from tandem.common.model.attention.cpu import load_ops
from tandem.common.model.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


class CpuAttentionBackend(AttentionBackend):
    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type != "cpu":
            raise ValueError(f"--attention-backend cpu runs on CPU only, not {self.device.type}; use torch or triton")
        self.ops = load_ops()
        logger.info("cpu attention: %s kernels (head dims up to 128; larger ones run the portable loops)",
                    self.ops.kernel_isa())

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        fb.attn_metadata = None  # the ops read the batch's own tensors: no plan, so a graph can replay any batch

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        if torch.compiler.is_compiling():  # Inductor fuses the torch ops itself
            super().rope_(x, cos, sin)
        else:
            self.ops.rope_(x, cos, sin)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if torch.compiler.is_compiling() or x.dim() not in (2, 3) or x.stride(-1) != 1:
            return super().rms_norm(x, weight, eps)
        return self.ops.rms_norm(x, weight, eps)

    def add_rms_norm_(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if torch.compiler.is_compiling() or residual.dim() != 2 or not residual.is_contiguous() or x.stride(-1) != 1:
            return super().add_rms_norm_(residual, x, weight, eps)
        return self.ops.add_rms_norm_(residual, x, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or gate_up.dim() != 2 or gate_up.stride(-1) != 1:
            return super().silu_and_mul(gate_up)
        return self.ops.silu_and_mul(gate_up)

    def fuses_gate_up_silu(self) -> bool:
        return not torch.compiler.is_compiling()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        k_buf, v_buf = pool.get_kv_buffer(layer_id)
        if pool.quantized or k.dtype != k_buf.dtype:
            pool.set_kv_buffer(layer_id, fb.out_cache_loc, k, v)  # scaled / cast on the way in
        else:
            self.ops.store_kv(k_buf, v_buf, fb.out_cache_loc, k, v)
        num_tokens, num_heads, head_dim = q.shape
        queries = q.to(pool.read_dtype(q.dtype))  # FP8, or 16-bit under float32: queries in the model's dtype
        if queries.stride(-1) != 1:
            queries = queries.contiguous()
        req_to_token = fb.req_to_token_pool.req_to_token
        scale = head_dim ** -0.5
        k_scale, v_scale = pool.k_scales[layer_id], pool.v_scales[layer_id]
        if fb.is_decode:
            out = self.ops.decode_attention(queries, k_buf, v_buf, req_to_token, fb.req_pool_indices, fb.seq_lens,
                                            scale, k_scale, v_scale)
        else:
            out = self.ops.extend_attention(queries, k_buf, v_buf, req_to_token, fb.req_pool_indices,
                                            fb.extend_prefix_lens, fb.extend_seq_lens, scale, k_scale, v_scale)
        return out.view(num_tokens, num_heads * head_dim).to(q.dtype)
