"""Attention backends behind one interface, chosen by name."""

from __future__ import annotations

import torch

from tandem.common.config import ATTENTION_BACKENDS, resolve_attention_backend
from tandem.common.model.attention.base import AttentionBackend
from tandem.common.model.attention.cpu_backend import CpuAttentionBackend
from tandem.common.model.attention.flashinfer_backend import FlashInferAttentionBackend
from tandem.common.model.attention.torch_backend import TorchAttentionBackend
from tandem.common.model.attention.triton_backend import TritonAttentionBackend

AVAILABLE_BACKENDS = ATTENTION_BACKENDS

def create_attention_backend(name: str, device: torch.device | str = "cpu", **kwargs) -> AttentionBackend:
    """The backend called `name` (`auto`: cpu on CPU, triton on CUDA)."""
    name = resolve_attention_backend(name, torch.device(device).type)
    if name == "cpu":
        return CpuAttentionBackend(device, **kwargs)
    if name == "torch":
        return TorchAttentionBackend(device, **kwargs)
    if name == "triton":
        return TritonAttentionBackend(device, **kwargs)
    if name == "flashinfer":
        return FlashInferAttentionBackend(device, **kwargs)
    raise ValueError(f"attention backend {name!r} is not available; available: {', '.join(AVAILABLE_BACKENDS)}")


__all__ = ["AttentionBackend", "AVAILABLE_BACKENDS", "create_attention_backend"]
