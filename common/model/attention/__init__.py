"""Attention backends behind one interface, chosen by name."""

from __future__ import annotations

from common.model.attention.base import AttentionBackend

AVAILABLE_BACKENDS = ("torch",)


def create_attention_backend(name: str, **kwargs) -> AttentionBackend:
    """The backend called `name`; FlashInfer and Triton will slot in here as siblings of torch."""
    if name == "torch":
        from common.model.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(**kwargs)
    raise ValueError(f"attention backend {name!r} is not available; available: {', '.join(AVAILABLE_BACKENDS)}")


__all__ = ["AttentionBackend", "AVAILABLE_BACKENDS", "create_attention_backend"]
