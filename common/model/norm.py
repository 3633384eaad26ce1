"""RMSNorm in torch ops, HF's arithmetic: the reference every backend's own norm kernel is tested against."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's order of operations (and roundings): normalize in float32, cast back to x's dtype, then scale by the
    weight; in place on the float32 copy (x.float() copies unless x is float32, hence the explicit clone there)."""
    dtype = x.dtype
    h = x.float() if dtype != torch.float32 else x.clone()
    scale = torch.rsqrt(torch.mean(torch.square(h), -1, keepdim=True).add_(eps))
    h = h.mul_(scale).to(dtype)
    return h.mul_(weight)


def add_rms_norm_(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x in place, then rms_norm(residual): a decoder layer's residual add and the norm after it."""
    return rms_norm(residual.add_(x), weight, eps)
