"""int4 GEMM on CPU: torch's int4-packed weight kernel, the weight unpacked inside the GEMM.

`aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)` computes x @ W.T with
W[n, k] = (q - 8) * s + m per group of `group` (32, 64, 128 or 256) consecutive input columns, q from
`_convert_weight_to_int4pack_for_cpu` (N a multiple of 16). AWQ/GPTQ's (q - z) * s is that with m = (8 - z) * s.
Its scales and offsets must be in x's dtype.

Groups must be contiguous runs of the kernel's group size. Act-order (GPTQ desc_act) scatters a group's input
columns, so the weight's columns are sorted by group once at load and every forward gathers x's columns in the same
order (one M x K gather). A group with fewer columns than its slots (a tensor-parallel rank's share of an act-order
group) is padded with columns whose input is a zero column appended to x: up to one padded run of the kernel's
group size per group present on the rank (compute, and resident bytes, grow by the padding; nothing when every
group is whole).

Which path a forward takes (timings: docs/quantization.md, AWQ and GPTQ):
- Where Tandem's GEMM kernel builds (common/model/cpu_gemm, AVX-512 or AVX2+FMA), float32 x, and bfloat16 /
  float16 x with fewer than DEQUANT_ROWS rows (widened to float32, the result rounded back): its 4-bit panels, the
  same sorted codes with a float32 scale and offset per group of `kgroup`, each weight made in registers.
  Elsewhere, 16-bit x with fewer than DEQUANT_ROWS rows: torch's kernel (its bf16 path is vectorized).
- float32 x without Tandem's kernel (torch's kernel's float32 path is a scalar loop, ~40x slower than a dense GEMM
  at 64 rows), and 16-bit x of DEQUANT_ROWS rows or more (prefill; a bf16 GEMM on AMX or avx512_bf16 outruns the
  4-bit kernel there): the weight is dequantized into a transient [N, K] tensor in x's dtype and multiplied
  densely; the full-precision copy lives only during that forward.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tandem.common.flags import ConfigError
from tandem.common.model import cpu_gemm
from tandem.common.model.quant.int4 import Int4Weight

KERNEL_GROUPS = (128, 64, 32)
N_MULTIPLE = 16  # the kernel's packing needs N a multiple of 16; other N are padded with zero rows
# The packed layout depends on the kernels ATen dispatches to on this CPU (ATEN_CPU_CAPABILITY): runs of BLOCK_N
# output rows, each stored [K, BLOCK_N / 2] bytes, a whole run with row j in the low nibble and row j + BLOCK_N / 2
# in the high one (AVX-512: 64 rows; AVX2: 32), or row 2j low and 2j + 1 high (no vector kernels: 32 rows, and the
# last, shorter run of any layout). (rows per run, whole runs split in halves), in the order tried.
LAYOUTS = ((64, True), (32, True), (32, False))
DEQUANT_ROWS = 64  # from here on, dequantize + dense GEMM beats the kernel (bf16, small preset, this CPU)


def kernel_group(group_size: int, k: int) -> int:
    """The largest kernel group dividing the format's group (a per-channel group: its K)."""
    for g in KERNEL_GROUPS:
        if group_size % g == 0:
            return g
    raise ConfigError(f"int4: group size {group_size} is not a multiple of {KERNEL_GROUPS[-1]} (K {k})")


def sort_by_group(g_idx: torch.Tensor, group_size: int, kgroup: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, slot_groups): slots[j] is the input column in sorted slot j (K: the zero column, padding), runs of
    each present group padded to a multiple of `kgroup`; slot_groups[r] the group of run r of `kgroup` slots."""
    k = g_idx.numel()
    order = torch.argsort(g_idx, stable=True)
    groups, counts = torch.unique_consecutive(g_idx[order], return_counts=True)
    if int(counts.max()) > group_size:
        raise ConfigError(f"int4: g_idx puts {int(counts.max())} input columns in one group of {group_size}")
    runs = (counts + kgroup - 1) // kgroup
    slots = torch.full((int(runs.sum()) * kgroup,), k, dtype=torch.long)
    starts = torch.cumsum(runs * kgroup, 0) - runs * kgroup
    rank_in_group = torch.arange(k) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    slots[torch.repeat_interleave(starts, counts) + rank_in_group] = order
    return slots, torch.repeat_interleave(groups, runs)


def unpack_int4pack(packed: torch.Tensor, n: int, k: int, layout: Optional[tuple[int, bool]] = None) -> torch.Tensor:
    """uint8 [N, K] from `_convert_weight_to_int4pack_for_cpu`'s output, in `layout` (LAYOUTS; default: the one
    this process's kernels write, packed_layout())."""
    block_n, split = layout or packed_layout()
    flat = packed.reshape(-1)
    full = n // block_n * block_n
    out = []
    if full:
        block = flat[:full * k // 2].view(n // block_n, k, block_n // 2)
        if split:
            rows = torch.cat([block & 0xF, block >> 4], 2)
        else:
            rows = torch.stack([block & 0xF, block >> 4], 3).reshape(n // block_n, k, block_n)
        out.append(rows.transpose(1, 2).reshape(full, k))
    if n > full:
        block = flat[full * k // 2:].view(k, (n - full) // 2)
        out.append(torch.stack([block & 0xF, block >> 4], 2).reshape(k, n - full).T)
    return out[0] if len(out) == 1 else torch.cat(out)


@functools.cache
def packed_layout() -> tuple[int, bool]:
    """The LAYOUTS entry `_convert_weight_to_int4pack_for_cpu` writes in this process, found by packing a probe
    whose rows fill whole runs and a shorter one in every layout; none matching fails loudly (a torch that packs
    another way)."""
    n, k = 80, 64
    probe = (torch.arange(n * k, dtype=torch.int32).view(n, k) * 7 + torch.arange(n, dtype=torch.int32)[:, None]) % 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    for layout in LAYOUTS:
        if torch.equal(unpack_int4pack(packed, n, k, layout), probe.to(torch.uint8)):
            return layout
    raise RuntimeError("int4: this torch's _convert_weight_to_int4pack_for_cpu writes none of the layouts "
                       f"unpack_int4pack reads {LAYOUTS}")


class CpuInt4Gemm(nn.Module):
    """x [M, K] @ W.T for one int4 weight, through the int4-packed kernel (see the module docstring)."""

    def __init__(self, weight: Int4Weight, dtype: torch.dtype):
        super().__init__()
        k, n = weight.in_features, weight.out_features
        self.in_features, self.out_features, self.dtype = k, n, dtype
        self.kgroup = kernel_group(weight.group_size, k)
        slots, slot_groups = sort_by_group(weight.g_idx, weight.group_size, self.kgroup)
        # None: the columns are already in group order with whole groups (no gather).
        identity = slots.numel() == k and torch.equal(slots, torch.arange(k))
        self.register_buffer("slots", None if identity else slots, persistent=False)
        self.pads = bool((slots == k).any())
        self.n_padded = -(-n // N_MULTIPLE) * N_MULTIPLE
        q = torch.cat([weight.q, torch.full((1, n), 8, dtype=torch.uint8)])[slots]  # [K_sorted, N]
        q = F.pad(q.T, (0, 0, 0, self.n_padded - n), value=8).contiguous()  # [N_padded, K_sorted]
        self.k_sorted = q.shape[1]
        scales = weight.scales[slot_groups]  # [runs, N]
        offsets = (8.0 - weight.zeros[slot_groups].float()) * scales
        pad = (0, self.n_padded - n)
        # Tandem's 4-bit kernel (common/model/cpu_gemm) where it builds: w = q * s + (m - 8 s), the kernel's weight
        # below, made in registers per forward (float32 rows, and 16-bit ones under DEQUANT_ROWS).
        self.ours = bool(cpu_gemm.panel_widths())
        if self.ours:
            s32 = F.pad(scales, pad).float()
            # float32 pairs whatever the model's dtype: the offset is -z * s, up to 15 scales, and bf16 would shift
            # a whole group by its rounding (the bf16 parity test measured 1.4x dense bf16's error that way)
            panels, sz = cpu_gemm.pack_int4(q, s32.T, (F.pad(offsets, pad).float() - 8 * s32).T, self.kgroup)
            self.register_buffer("panels", panels, persistent=False)
            self.register_buffer("sz", sz, persistent=False)
            return
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1)
        if not torch.equal(unpack_int4pack(packed, *q.shape), q):
            raise RuntimeError("int4: this torch's _convert_weight_to_int4pack_for_cpu layout is not the one "
                               "unpack_int4pack reads")
        self.register_buffer("packed", packed, persistent=False)
        sz = torch.stack([F.pad(scales, pad), F.pad(offsets, pad)], -1)  # [runs, N_padded, 2]
        self.register_buffer("scales_and_zeros", sz.to(dtype).contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if self.slots is not None:
            x = (F.pad(x, (0, 1)) if self.pads else x)[:, self.slots]
        if self.ours and (x.dtype == torch.float32 or x.shape[0] < DEQUANT_ROWS):
            out = cpu_gemm.quant_linear(x, self.panels, self.sz, self.n_padded, self.kgroup)
        elif x.dtype == torch.float32 or x.shape[0] >= DEQUANT_ROWS:
            out = F.linear(x, self._sorted_weight(x.dtype))
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.kgroup,
                                                             self.scales_and_zeros)
        return out[:, :self.out_features] if self.n_padded != self.out_features else out

    def _sorted_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """[N_padded, K_sorted] in `dtype`: the kernel's (q - 8) * s + m, computed in float32 in place as
        q * s + (m - 8 s) and rounded to `dtype` once (a broadcast addcmul in bf16 is ~5x slower); on Tandem's
        kernel, the weight it multiplies by (cpu_gemm.unpack_panels)."""
        n, k = self.n_padded, self.k_sorted
        if self.ours:  # the kernel's weight, q * s + offset
            return cpu_gemm.unpack_panels(self.panels, self.sz, n, self.kgroup).to(dtype)
        w = unpack_int4pack(self.packed, n, k).view(n, k // self.kgroup, self.kgroup).float()
        sz = self.scales_and_zeros.float().transpose(0, 1)  # [N, runs, 2]
        scale, offset = sz[..., :1], sz[..., 1:]
        w = w.mul_(scale).add_(offset - 8 * scale).view(n, k)
        return w if dtype == torch.float32 else w.to(dtype)

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32 in the checkpoint's column order."""
        sorted_w = self._sorted_weight(torch.float32)[:self.out_features]
        if self.slots is None:
            return sorted_w
        out = torch.zeros(self.out_features, self.in_features + 1)
        out[:, self.slots] = sorted_w
        return out[:, :self.in_features]
