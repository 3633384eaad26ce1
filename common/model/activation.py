"""The SwiGLU MLP's activation in torch ops, HF's arithmetic: the reference every backend's own kernel is tested
against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up over the fused projection's output [..., 2I] (gate first), with HF's roundings: silu rounded to
    the dtype, then the product. silu runs out of place so the result is contiguous (down_proj's oneDNN would copy a
    strided input: gate is every other half-row of the fused output)."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate).mul_(up)
