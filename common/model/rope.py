"""Rotary position embedding applied in place, HF's arithmetic without its rotate_half copy."""

from __future__ import annotations

import torch


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] in place by cos/sin [T, 1, D/2]: HF's x * cos + rotate_half(x) * sin, with the same
    roundings (each product rounded to x's dtype, then the sum), without building rotate_half(x)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    x1_sin = x1 * sin
    x1.mul_(cos).sub_(x2 * sin)
    x2.mul_(cos).add_(x1_sin)
    return x
