"""GGUF's block formats unpacked into integer codes and per-group scales: w = q * scale + offset.

Each block type is read from its raw bytes ([rows, bytes per row], as the file stores a row) into
  q      [rows, cols] small integers (uint8 0..15 for the 4-bit types, int8 for Q8_0 and Q6_K),
  scale  [rows, cols / group] float32,
  offset [rows, cols / group] float32, or None where the format has no offset.
The layouts follow ggml's dequantize_row_* (ggml-quants.c); gguf.quants.dequantize is the tests' reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

# GGML type id -> (name, elements per block, bytes per block); the float types are plain tensors.
FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}
BLOCK_TYPES = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144),
               14: ("Q6_K", 256, 210)}
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # codes 0..15 in groups of 32: torch's CPU int4 kernel runs them as stored


@dataclass
class Codes:
    """A weight as integer codes and group scales: w[r, c] = q[r, c] * scale[r, c // group] (+ offset[...])."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: Optional[torch.Tensor]
    group: int

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.q.shape
        w = self.q.float().view(rows, -1, self.group) * self.scale.unsqueeze(-1)
        if self.offset is not None:
            w = w + self.offset.unsqueeze(-1)
        return w.view(rows, cols)


def type_name(type_id: int) -> str:
    if type_id in FLOAT_TYPES:
        return FLOAT_TYPES[type_id]
    if type_id in BLOCK_TYPES:
        return BLOCK_TYPES[type_id][0]
    return f"type {type_id}"


def _f16(raw: torch.Tensor, start: int) -> torch.Tensor:
    """The little-endian float16 at byte `start` of every block, as float32 [..., 1]."""
    return raw[..., start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: the n low nibbles, then the n high ones (ggml's order within a block)."""
    return torch.stack([qs & 0x0F, qs >> 4], dim=-2).flatten(-2)


def unpack(type_id: int, raw: torch.Tensor, cols: int) -> Codes:
    """Codes of a block-quantized weight stored as `raw` (uint8 [rows, bytes per row]) with `cols` columns."""
    name, block, size = BLOCK_TYPES[type_id]
    rows = raw.shape[0]
    blocks = raw.view(rows, cols // block, size)
    if name == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8)
        return Codes(q.reshape(rows, cols), _f16(blocks, 0)[..., 0], None, 32)
    if name == "Q4_0":
        d = _f16(blocks, 0)[..., 0]
        return Codes(_nibbles(blocks[..., 2:]).reshape(rows, cols), d, -8 * d, 32)
    if name == "Q4_1":
        return Codes(_nibbles(blocks[..., 4:]).reshape(rows, cols), _f16(blocks, 0)[..., 0], _f16(blocks, 2)[..., 0], 32)
    if name == "Q4_K":
        return _unpack_q4_k(blocks, rows, cols)
    return _unpack_q6_k(blocks, rows, cols)


def _unpack_q4_k(blocks: torch.Tensor, rows: int, cols: int) -> Codes:
    """256 weights: d, dmin (f16), 12 bytes of eight 6-bit (scale, min) pairs, 128 bytes of nibbles; sub-block j
    of 32 is w = d * sc[j] * q - dmin * m[j]; bytes 32i..32i+31 hold sub-block 2i (low) and 2i+1 (high)."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc_bytes = blocks[..., 4:16].to(torch.int32)
    low, high = sc_bytes[..., 0:4], sc_bytes[..., 4:8]
    tail = sc_bytes[..., 8:12]
    sc = torch.cat([low & 63, (tail & 0x0F) | ((low >> 6) << 4)], dim=-1).float()
    mn = torch.cat([high & 63, (tail >> 4) | ((high >> 6) << 4)], dim=-1).float()
    qs = blocks[..., 16:].reshape(rows, -1, 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(rows, cols)
    scale = (d * sc).reshape(rows, -1)
    return Codes(q, scale, (-dmin * mn).reshape(rows, -1), 32)


def _unpack_q6_k(blocks: torch.Tensor, rows: int, cols: int) -> Codes:
    """256 weights: ql (128 bytes of low nibbles), qh (64 bytes of 2-bit highs), 16 int8 scales, d (f16); each
    half of 128 is four runs of 32 = (ql[l] low, ql[l+32] low, ql[l] high, ql[l+32] high) | qh[l] bits 0-1, 2-3,
    4-5, 6-7, minus 32; sub-block of 16 k has w = d * scales[k] * q."""
    nb = blocks.shape[1]
    ql = blocks[..., 0:128].reshape(rows, nb, 2, 2, 32)  # [half, ql[l] or ql[l+32], l]
    qh = blocks[..., 128:192].reshape(rows, nb, 2, 1, 32)
    low = torch.stack([ql[..., 0, :] & 0x0F, ql[..., 1, :] & 0x0F, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4], dim=3)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1)
    high = (qh >> shifts) & 3
    q = (low.to(torch.int16) | (high.to(torch.int16) << 4)) - 32
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
    d = _f16(blocks, 208)
    return Codes(q.to(torch.int8).reshape(rows, cols), (d * scales).reshape(rows, -1), None, 16)
