"""AttentionBackend: the one interface every attention implementation (torch, FlashInfer, Triton) meets."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from common.model.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Plans a batch once (init_forward_metadata), then runs attention for every layer of it.

    forward() writes the new tokens' K/V into the pool at fb.out_cache_loc, then attends each new
    token over its request's whole KV (req_to_token[req_pool_indices[i], :seq_lens[i]]), causally:
    new token j of request i sits at position extend_prefix_lens[i] + j.
    """

    @abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Build the per-batch plan (index tensors, masks) and store it in fb.attn_metadata."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> attention output [T, Hq * D]."""
