"""AttentionBackend: the one interface every attention implementation (cpu, torch, Triton, FlashInfer) meets."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tandem.common.model import activation, norm
from tandem.common.model.forward_batch import ForwardBatch
from tandem.common.model.rope import apply_rope_


class AttentionBackend(ABC):
    """Plans a batch once (init_forward_metadata), then runs attention for every layer of it.

    forward() writes the new tokens' K/V into the pool at fb.out_cache_loc, then attends each new
    token over its request's whole KV (req_to_token[req_pool_indices[i], :seq_lens[i]]), causally:
    new token j of request i sits at position extend_prefix_lens[i] + j.
    """

    def configure(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        """The attention shape of this rank's model (its own heads under tensor parallelism) and its dtype, given
        once when the model is built; a backend that plans by them keeps them, or refuses what it cannot run."""

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate the heads x [T, H, D] in place by cos/sin [T, 1, D/2] (common/model/rope.py's arithmetic, which a
        backend with its own kernel meets bitwise)."""
        apply_rope_(x, cos, sin)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of x's rows (common/model/norm.py's arithmetic; a backend's own kernel meets it to a few ulps: its
        sum of squares adds in another order)."""
        return norm.rms_norm(x, weight, eps)

    def add_rms_norm_(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x in place, then the RMSNorm of residual's rows."""
        return norm.add_rms_norm_(residual, x, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The SwiGLU activation silu(gate) * up of the fused gate/up output [..., 2I] (common/model/activation.py's
        arithmetic; a backend's own kernel meets it to an ulp)."""
        return activation.silu_and_mul(gate_up)

    def fuses_gate_up_silu(self) -> bool:
        """Whether silu_and_mul(x @ [gate; up].T) may run as one pass of our GEMM kernel where a packed layer runs
        that kernel (common/model/cpu_linear.py's gate_up_silu): bitwise this backend's two calls. The cpu backend's
        silu_and_mul is that pass's arithmetic; others keep the two calls."""
        return False

    @abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Build the per-batch plan (index tensors, masks) and store it in fb.attn_metadata."""

    # CUDA graphs of the decode step (common/model/graph_runner.py), in SGLang's three steps: state for every
    # bucket, the plan a bucket is captured on, and the plan of each batch it replays.

    def init_graph_state(self, max_batch_size: int, max_context_len: int) -> None:
        """Before any bucket is captured: allocate what the graphs share."""

    def init_graph_metadata(self, fb: ForwardBatch) -> None:
        """Plan the batch a bucket's graph is captured on; the tensors of this plan are the ones the graph reads."""
        self.init_forward_metadata(fb)

    def replay_graph_metadata(self, static: ForwardBatch, fb: ForwardBatch) -> None:
        """Right before the graph captured on `static` replays `fb` (planned by init_forward_metadata, its inputs
        already copied into `static`): make static's plan fb's. Nothing to do for a backend whose decode plan is
        only the batch tensors."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> attention output [T, Hq * D]."""
