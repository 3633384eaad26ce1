"""Tandem's own float32 GEMM (a register-blocked micro-kernel over a weight packed once into column panels, which
may hold bfloat16 or float16 weights widened in registers, or 4-bit, int8 or float8_e4m3fn codes with group scales
and offsets turned into float32 weights in registers) and the FMA-peak probe: C++ torch ops built on first use and
cached per machine (common/model/cpp_build.py)."""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Optional

import torch

from tandem.common.model.cpp_build import CppBuildError, build_and_load

__all__ = ["CppBuildError", "load_ops", "panel_widths", "pack_weight", "packed_linear", "packed_gate_up_silu",
           "moe_experts", "pack_int4", "pack_int8", "pack_fp8", "packed_quant_linear", "quant_linear", "unpack_panels",
           "quant_sz_dtype"]

SOURCES = (Path(__file__).with_name("gemm.cpp"), Path(__file__).with_name("probe.cpp"))

_lock = threading.Lock()
_loaded = False


def load_ops():
    """torch.ops.tandem_gemm, built the first time on this machine; raises CppBuildError."""
    global _loaded
    if _loaded:  # no lock once built: torch.compile traces through this call
        return torch.ops.tandem_gemm
    with _lock:
        if not _loaded:
            build_and_load("tandem_cpu_gemm", SOURCES, "the CPU GEMM kernels")
            _register_fakes()
            _loaded = True
    return torch.ops.tandem_gemm


def _register_fakes() -> None:
    """Shapes for torch.compile's tracing (`--enable-torch-compile`): the linears return a new float32 [.., n]."""

    @torch.library.register_fake("tandem_gemm::packed_quant_linear")
    def _quant(x, codes, sz, n, group, bias=None):
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("tandem_gemm::packed_linear")
    def _linear(x, packed, n, bias=None):
        return x.new_empty((*x.shape[:-1], n))


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


def _quant_width(width: Optional[int]) -> int:
    if width is None:
        if not panel_widths():
            raise CppBuildError("the CPU GEMM kernel needs AVX-512 or AVX2+FMA, and a C++ compiler")
        width = panel_widths()[0]
    return width


def _group_pairs(rows: int, cols: int, scale: torch.Tensor, offset: Optional[torch.Tensor], group: int,
                 width: int) -> torch.Tensor:
    """[P, ceil(K / group), 2, width] float32: each panel's group scales, then offsets (zero in the rows past N);
    [.., 1, width], the scales alone, where offset is None."""
    groups = -(-cols // group) if group > 0 else 0
    if group <= 0 or scale.shape != (rows, groups):
        raise ValueError(f"pack: a [{rows}, {cols}] weight needs [{rows}, {groups}] group scales (the last group may "
                         f"be short), got {tuple(scale.shape)} (group {group})")
    if offset is not None and offset.shape != scale.shape:
        raise ValueError(f"pack: offsets {tuple(offset.shape)} are not shaped like the scales")
    panels, pairs = -(-rows // width), 1 if offset is None else 2
    sz = torch.zeros(pairs, panels * width, groups, dtype=torch.float32)
    sz[0, :rows] = scale.float()
    if offset is not None:
        sz[1, :rows] = offset.float()
    return sz.view(pairs, panels, width, groups).permute(1, 3, 0, 2).contiguous()


def _code_panels(q: torch.Tensor, dtype: torch.dtype, width: int) -> torch.Tensor:
    """q [N, K] as [P, K, width] panels of `dtype`, the rows past N zero."""
    rows, cols = q.shape
    panels = -(-rows // width)
    codes = torch.zeros(panels * width, cols, dtype=dtype)
    codes[:rows] = q
    return codes.view(panels, width, cols).transpose(1, 2)


def pack_int4(q: torch.Tensor, scale: torch.Tensor, offset: Optional[torch.Tensor], group: int,
              width: Optional[int] = None, sz_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A 4-bit weight w[r, c] = q[r, c] * scale[r, c // group] + offset[r, c // group] (q in 0..15, [N, K]; scale
    and offset [N, K / group], offset None: zero) as panels for packed_quant_linear: (codes [P, K, width / 2] uint8,
    byte j of a row holding column j in its low nibble and j + width / 2 in its high one; sz [P, K / group, 2, width]
    float32 (the scales alone, [.., 1, width], where offset is None; sz_dtype bfloat16: a bfloat16 model's
    rounding), P = ceil(N / width), the rows past N zero. width: the widest variant."""
    width = _quant_width(width)
    rows, cols = q.shape
    sz = _group_pairs(rows, cols, scale, offset, group, width).to(sz_dtype)
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError("pack_int4: a code outside 0..15")
    codes = _code_panels(q.to(torch.uint8), torch.uint8, width)
    half = width // 2
    return (codes[..., :half] | (codes[..., half:] << 4)).contiguous(), sz


def pack_int8(q: torch.Tensor, scale: torch.Tensor, offset: Optional[torch.Tensor], group: int,
              width: Optional[int] = None, sz_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_int4 for signed 8-bit codes (q int8 [N, K], GGUF's Q8_0 and Q6_K): codes [P, K, width] int8."""
    width = _quant_width(width)
    if q.dtype != torch.int8:
        raise ValueError(f"pack_int8: int8 codes, not {q.dtype}")
    rows, cols = q.shape
    return (_code_panels(q, torch.int8, width).contiguous(),
            _group_pairs(rows, cols, scale, offset, group, width).to(sz_dtype))


def pack_fp8(weight: torch.Tensor, scale: torch.Tensor, group: int, width: Optional[int] = None,
             sz_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A float8_e4m3fn weight [N, K] times scale [N, ceil(K / group)] as panels for packed_quant_linear: codes
    [P, K, width] float8_e4m3fn (the kernel reads each as 2^-8 of its value: the scales are packed times 2^8,
    exactly) and sz as pack_int4's, no offsets."""
    width = _quant_width(width)
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"pack_fp8: float8_e4m3fn weights, not {weight.dtype}")
    rows, cols = weight.shape
    sz = _group_pairs(rows, cols, scale.float() * 256, None, group, width).to(sz_dtype)
    panels = -(-rows // width)
    codes = torch.zeros(panels * width, cols, dtype=torch.uint8)
    codes[:rows] = weight.view(torch.uint8)
    return codes.view(panels, width, cols).transpose(1, 2).contiguous().view(torch.float8_e4m3fn), sz


def unpack_panels(codes: torch.Tensor, sz: torch.Tensor, out_features: int, group: int) -> torch.Tensor:
    """The float32 weight [N, K] that packed_quant_linear multiplies by, q * scale + offset of each code, in float32
    (a multiply, then an add: within a rounding of the kernel's fused multiply-add, and equal to it where there is
    no offset); no wider temporary than the result."""
    panels, cols = codes.shape[0], codes.shape[1]
    if codes.dtype == torch.uint8:  # 4-bit: byte j of a row holds column j and j + width / 2
        q = torch.cat([codes & 0xF, codes >> 4], -1)
    elif codes.dtype == torch.float8_e4m3fn:
        q = codes.float() / 256  # the kernel's reading (exact); the packed scales carry the 2^8
    else:
        q = codes
    width, groups = q.shape[2], sz.shape[1]
    w = torch.zeros(out_features, groups * group, dtype=torch.float32)
    w[:, :cols] = q.transpose(1, 2).reshape(panels * width, cols)[:out_features]
    pairs = sz.float().permute(0, 3, 1, 2).reshape(panels * width, groups, sz.shape[2])[:out_features]
    grouped = w.view(out_features, groups, group).mul_(pairs[..., :1])
    if sz.shape[2] == 2:
        grouped.add_(pairs[..., 1:])
    return w if groups * group == cols else w[:, :cols].contiguous()


def packed_quant_linear(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, out_features: int, group: int,
                        bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x @ W.T (+ bias) over `pack_int4`'s, `pack_int8`'s or `pack_fp8`'s panels of W, x, bias and the result
    float32 (a 16-bit model widens its rows and rounds the result): each weight is q * scale + offset, made in
    registers with one fused multiply-add (one rounding where the formats' two-step formula has two; exact where
    the offset is zero or a power-of-two multiple of the scale)."""
    return load_ops().packed_quant_linear(x, codes, sz, out_features, group, bias)


def quant_linear(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, out_features: int, group: int,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """packed_quant_linear for a layer of any float dtype: x and bias widened to float32 (no copy in float32), the
    result rounded back to x's dtype."""
    bias = None if bias is None else bias.float()
    return packed_quant_linear(x.float(), codes, sz, out_features, group, bias).to(x.dtype)


def quant_sz_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a quantized layer's scales and offsets are held in for a model of `dtype`: bfloat16 for a bfloat16
    model (the bytes and rounding torch's int4 kernel gives them there), else float32."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


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
