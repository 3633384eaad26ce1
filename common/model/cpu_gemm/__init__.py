"""Tandem's own float32 GEMM (a register-blocked micro-kernel over a weight packed once into column panels, which
may hold bfloat16 or float16 weights widened in registers) and the FMA-peak probe: C++ torch ops built on first use
and cached per machine (common/model/cpp_build.py)."""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Optional

import torch

from tandem.common.model.cpp_build import CppBuildError, build_and_load

__all__ = ["CppBuildError", "load_ops", "panel_widths", "pack_weight", "packed_linear", "packed_gate_up_silu",
           "moe_experts"]

SOURCES = (Path(__file__).with_name("gemm.cpp"), Path(__file__).with_name("probe.cpp"))

_lock = threading.Lock()
_loaded = False


def load_ops():
    """torch.ops.tandem_gemm, built the first time on this machine; raises CppBuildError."""
    global _loaded
    with _lock:
        if not _loaded:
            build_and_load("tandem_cpu_gemm", SOURCES, "the CPU GEMM kernels")
            _loaded = True
    return torch.ops.tandem_gemm


@functools.cache
def panel_widths() -> tuple[int, ...]:
    """The kernel variants this CPU runs, by panel width, widest first: 32 (AVX-512), 16 (AVX2+FMA); () where
    neither is present or the build fails."""
    try:
        return tuple(load_ops().gemm_panel_widths())
    except CppBuildError:
        return ()


def pack_weight(weight: torch.Tensor, width: Optional[int] = None) -> torch.Tensor:
    """A float32, bfloat16 or float16 [N, K] weight as [ceil(N / width), K, width] panels of its dtype (zero-padded);
    width: the widest variant."""
    if width is None:
        if not panel_widths():
            raise CppBuildError("the CPU GEMM kernel needs AVX-512 or AVX2+FMA, and a C++ compiler")
        width = panel_widths()[0]
    return load_ops().pack_weight(weight.detach().contiguous(), width)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x @ weight.T (+ bias) over `pack_weight(weight)`, x and bias float32 whatever the panels hold; the variant is
    the one the panels were packed for."""
    return load_ops().packed_linear(x, packed, out_features, bias)


def packed_gate_up_silu(x: torch.Tensor, packed: torch.Tensor, inter: int,
                        out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """silu(gate) * up of x @ [gate; up].T over `pack_weight` of the fused [2 * inter, K] weight, never writing the
    [.., 2 * inter] product: x float32, the result in out_dtype (default float32) rounded as the two ops round it
    (packed_linear's output cast to out_dtype, then attention/cpu's silu_and_mul). inter must be a multiple of the
    panel width."""
    return load_ops().packed_gate_up_silu(x, packed, inter, out_dtype)


def moe_experts(x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor, w13: list[torch.Tensor],
                w2: list[torch.Tensor], inter: int) -> torch.Tensor:
    """An MoE layer's local experts over float32 rows x [T, H] in one call, bitwise Experts._grouped_loop over our
    kernel (common/model/moe.py): local_ids [T, k] (-1: held elsewhere), weights [T, k] float32, w13[e] / w2[e] the
    float32 panels of expert e's gate/up [2 * inter, H] and down [H, inter] weights."""
    return load_ops().moe_experts(x, local_ids, weights, w13, w2, inter)
