"""GGUF weights served in their quantized form: the QuantMethod for `--model FILE.gguf` (quant/base.py).

Two kinds of projection, chosen per tensor type:
- Q4_0, Q4_1, Q4_K (codes 0..15 in groups of 32, w = q * s + offset) run as stored: on Tandem's 4-bit kernel
  where it builds (common/model/cpu_gemm, w made in registers by one fused multiply-add, 16-bit rows widened to
  float32), else on torch's CPU int4 kernel, whose `_weight_int4pack_mm_for_cpu` computes w = (q - 8) * s + z per
  group, so z = offset + 8 s. Resident: half a byte a weight plus a (scale, offset) pair per 32, float32 (bf16 for
  a bf16 model): 0.75 B/weight, 0.625 in bf16.
- Q8_0 and Q6_K (int8 codes, groups of 32 and 16): on CPU where Tandem's kernel builds, its 8-bit panels with a
  scale per group (Q8_0 1.125 B/weight in bf16, 1.25 in float32). Elsewhere one int8 code a weight plus float32
  group scales (and the same scales in the model's dtype for torch's int8 kernel): Q8_0 1.19 B/weight in bf16,
  Q6_K 1.375. A decode step
  of up to 4 rows runs group by group on `_weight_int8pack_mm`; larger batches dequantize bounded blocks of output
  rows (2^20 weights at a time) inside the forward: no full-precision copy, every weight converted per call. The
  4-bit types take that path too (one byte a code) where the int4 kernel cannot run (off CPU, or out_features not
  a multiple of 16).
F32/F16/BF16 projections stay plain tensors. The token embedding stays quantized too: a lookup dequantizes the
rows it needs, and a tied LM head multiplies by the same codes.
Under tensor parallelism the codes are split as stored: column-parallel ranks take output rows (q/k un-permuted
first), row-parallel ranks take whole blocks of input columns (check() refuses a --tp-size that cuts one), and the
embedding and LM head keep each rank's vocabulary rows quantized (parallel/layers.py's vocab-parallel scheme).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tandem.common.errors import UnsupportedModelError
from tandem.common.flags import ConfigError
from tandem.common.model import cpu_gemm
from tandem.common.model.config import ModelConfig
from tandem.common.model.quant.base import (CheckpointReader, LinearSource, QuantizedLinear, QuantMethod,
                                            linear_sources)
from tandem.common.model.quant.gguf_file import GGUFReader
from tandem.common.model.quant.gguf_quants import BLOCK_TYPES, FLOAT_TYPES, INT4_TYPES, Codes, unpack

GROUP = 32  # the 4-bit types' group of input columns (Q4_K's sub-blocks)
_BLOCK_ELEMENTS = 1 << 20  # weights dequantized at a time by GroupedLinear (4 MiB in float32)


class Int4Linear(QuantizedLinear):
    """A 4-bit projection multiplied as stored: on Tandem's 4-bit kernel where it builds (common/model/cpu_gemm:
    codes in panels of its width, [P, K, width / 2] bytes, and a (scale, offset) pair per group of 32, float32, or
    bf16 for a bf16 model; each weight made in registers as q * s + offset, 16-bit rows widened to float32);
    torch's float32 int4 kernel is a scalar loop, 25-170x slower (docs/quantization.md). Otherwise torch's CPU int4
    kernel: packed codes [N, K/2] and (scale, zero) [K/32, N, 2] in the layer's dtype. Either way half a byte a
    weight plus a pair per 32."""

    def __init__(self, codes: Codes, dtype: torch.dtype, bias: bool):
        rows, cols = codes.q.shape
        super().__init__(cols, rows, bias, dtype)
        self.ours = bool(cpu_gemm.panel_widths())
        if self.ours:
            panels, sz = cpu_gemm.pack_int4(codes.q, codes.scale, codes.offset, codes.group,
                                            sz_dtype=cpu_gemm.quant_sz_dtype(dtype))
            self.register_buffer("panels", panels)
            self.register_buffer("sz", sz)
            return
        offset = codes.offset if codes.offset is not None else torch.zeros_like(codes.scale)
        zeros = offset + 8 * codes.scale
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.q.to(torch.int32).contiguous(), 1)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", torch.stack([codes.scale.t(), zeros.t()], dim=-1).to(dtype).contiguous())

    @staticmethod
    def runs(codes: Codes, device: torch.device) -> bool:
        return device.type == "cpu" and codes.group == 32 and codes.q.shape[0] % 16 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ours:
            return cpu_gemm.quant_linear(x, self.panels, self.sz, self.out_features, GROUP, self.bias)
        flat = x.reshape(-1, self.in_features).to(self.scales_and_zeros.dtype).contiguous()
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_and_zeros)
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def dequantize(self) -> torch.Tensor:
        if self.ours:
            return cpu_gemm.unpack_panels(self.panels, self.sz, self.out_features, GROUP)
        eye = torch.eye(self.in_features, dtype=self.scales_and_zeros.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, self.scales_and_zeros).t().float()


class GroupedLinear(QuantizedLinear):
    """Int8 codes with float32 group scales (and offsets). On CPU, Tandem's kernel over 8-bit panels where it builds
    (common/model/cpu_gemm), each weight made in registers. Otherwise the codes are held group-major
    ([K / group, N, group]): a decode step of a few rows multiplies group by group on torch's int8 kernel
    (`_weight_int8pack_mm`, one scale per row of a group's slice), summed in float32; larger batches dequantize
    blocks of output rows and multiply."""

    def __init__(self, codes: Codes, dtype: torch.dtype, bias: bool, device: torch.device):
        rows, cols = codes.q.shape
        super().__init__(cols, rows, bias, dtype, device)
        self.group = codes.group
        self.block_rows = max(1, _BLOCK_ELEMENTS // cols)
        # On CPU: Tandem's kernel over 8-bit panels (a 4-bit code is a byte here too) with group scales and offsets
        # (float32, bf16 for a bf16 model), each weight made in registers; a byte a weight plus a pair a group.
        self.ours = device.type == "cpu" and bool(cpu_gemm.panel_widths())
        if self.ours:
            self.width = cpu_gemm.panel_widths()[0]
            panels, sz = cpu_gemm.pack_int8(codes.q.to(torch.int8), codes.scale, codes.offset, self.group, self.width,
                                            cpu_gemm.quant_sz_dtype(dtype))
            self.register_buffer("panels", panels)
            self.register_buffer("sz", sz)
            self.has_offset = codes.offset is not None
            return
        by_group = codes.q.view(rows, -1, self.group).transpose(0, 1).contiguous()
        self.register_buffer("q", by_group.to(device))
        self.register_buffer("scale", codes.scale.to(device))
        self.register_buffer("offset", None if codes.offset is None else codes.offset.to(device))
        self.per_group = device.type == "cpu" and codes.q.dtype == torch.int8 and codes.offset is None
        # the int8 kernel's scales: [K / group, N] in the activations' dtype (another 2 or 4 bytes a group)
        self.register_buffer("group_scales", codes.scale.t().to(device=device, dtype=dtype).contiguous()
                             if self.per_group else None)

    def rows(self, index, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows `index` (a slice or a tensor of row ids), [rows, K] in `dtype`."""
        if self.ours:
            return self._panel_rows(index, dtype)
        q = self.q[:, index].transpose(0, 1)
        w = torch.empty(q.shape, dtype=dtype, device=q.device)
        w.copy_(q)
        w.mul_(self.scale[index].to(dtype).unsqueeze(-1))
        if self.offset is not None:
            w.add_(self.offset[index].to(dtype).unsqueeze(-1))
        return w.view(w.shape[0], self.in_features)

    def _panel_rows(self, index, dtype: torch.dtype) -> torch.Tensor:
        """rows() from the kernel's panels: row r is column r % width of panel r // width."""
        ids = torch.arange(self.out_features)[index] if isinstance(index, slice) else index
        panel, column = ids // self.width, ids % self.width
        q = self.panels[panel, :, column]  # [rows, K]
        w = torch.empty(q.shape, dtype=dtype, device=q.device)
        w.copy_(q)
        w = w.view(len(ids), -1, self.group)
        w.mul_(self.sz[panel, :, 0, column].to(dtype).unsqueeze(-1))
        if self.has_offset:
            w.add_(self.sz[panel, :, 1, column].to(dtype).unsqueeze(-1))
        return w.view(len(ids), self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ours:
            return cpu_gemm.quant_linear(x, self.panels, self.sz, self.out_features, self.group, self.bias)
        flat = x.reshape(-1, self.in_features)
        out = self._by_group(flat) if self.per_group and flat.shape[0] <= 4 else self._by_rows(flat)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def _by_rows(self, flat: torch.Tensor) -> torch.Tensor:
        out = flat.new_empty(flat.shape[0], self.out_features)
        for start in range(0, self.out_features, self.block_rows):
            stop = min(start + self.block_rows, self.out_features)
            torch.matmul(flat, self.rows(slice(start, stop), flat.dtype).t(), out=out[:, start:stop])
        return out

    def _by_group(self, flat: torch.Tensor) -> torch.Tensor:
        scales = self.group_scales.to(flat.dtype)
        out = torch.zeros(flat.shape[0], self.out_features, dtype=torch.float32, device=flat.device)
        for g in range(self.q.shape[0]):
            piece = flat[:, g * self.group:(g + 1) * self.group].contiguous()
            out += torch.ops.aten._weight_int8pack_mm(piece, self.q[g], scales[g])
        return out.to(flat.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.rows(slice(None), torch.float32)


class PlainLinear(QuantizedLinear):
    """A projection the file stores as F32/F16/BF16: its weight in the model's dtype, as a buffer."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, bias: bool, device: torch.device):
        super().__init__(weight.shape[1], weight.shape[0], bias, dtype, device)
        self.register_buffer("weight", weight.to(device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()


class StackedLinear(QuantizedLinear):
    """Parts of a fused projection stored in different types (Q4_K_M files keep some v_proj in Q6_K): each part
    runs its own kernel; outputs are concatenated along the features."""

    def __init__(self, parts: list[QuantizedLinear], dtype: torch.dtype, bias: bool, device: torch.device):
        super().__init__(parts[0].in_features, sum(p.out_features for p in parts), bias, dtype, device)
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([p(x) for p in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


class QuantizedEmbedding(nn.Module):
    """The token embedding kept quantized: a lookup dequantizes only the rows of its ids. Under tensor parallelism
    (`group`) the table holds this rank's vocabulary rows from `start` (parallel/layers.VocabParallelEmbedding):
    ids elsewhere give zero rows, and the all-reduce adds the one non-zero row per token."""

    def __init__(self, table: GroupedLinear | PlainLinear, dtype: torch.dtype, start: int = 0, group=None):
        super().__init__()
        self.table, self.dtype = table, dtype
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.start, self.group = start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.table
        flat = ids.reshape(-1)
        outside = None
        if self.group is not None:
            flat = flat - self.start
            outside = (flat < 0) | (flat >= self.num_embeddings)
            flat = flat.masked_fill(outside, 0)
        if isinstance(table, GroupedLinear):
            rows = table.rows(flat, self.dtype)
        else:
            rows = table.weight[flat]
        rows = rows.to(self.dtype)
        if outside is not None:
            rows = rows.masked_fill(outside[:, None], 0)
        rows = rows.reshape(*ids.shape, self.embedding_dim)
        return rows if self.group is None else self.group.all_reduce(rows)


def _linear(codes_or_weight, type_name: str, dtype: torch.dtype, device: torch.device, bias: bool,
            int4: bool = True) -> QuantizedLinear:
    if type_name in FLOAT_TYPES.values():
        return PlainLinear(codes_or_weight, dtype, bias, device)
    if int4 and type_name in INT4_TYPES and Int4Linear.runs(codes_or_weight, device):
        return Int4Linear(codes_or_weight, dtype, bias)
    return GroupedLinear(codes_or_weight, dtype, bias, device)


def _block(read: GGUFReader, name: str) -> int:
    """The columns one block of the tensor's type spans (1 for a float type)."""
    t = read.tensor(name)
    return BLOCK_TYPES[t.type_id][1] if t.type_id in BLOCK_TYPES else 1


def _read(read: GGUFReader, name: str, rows: Optional[range], cols: Optional[range] = None, pad_to: int = 0):
    """A tensor's codes (block type) or values (float type): `rows` in HF order (q/k's permutation undone first),
    `cols` a run of whole blocks (a row-parallel rank's input columns), zero rows appended up to `pad_to` (the last
    vocab-parallel rank: all-zero bytes are zero weights in every block type)."""
    t = read.tensor(name)
    raw = read.raw(name, rows)
    if pad_to > raw.shape[0]:
        raw = torch.cat([raw, raw.new_zeros(pad_to - raw.shape[0], *raw.shape[1:])])
    if t.type_id not in BLOCK_TYPES:
        return raw if cols is None else raw[:, cols.start:cols.stop].contiguous()
    _, block, size = BLOCK_TYPES[t.type_id]
    if cols is None:
        return unpack(t.type_id, raw, t.shape[1])
    if cols.start % block or len(cols) % block:  # check() refuses these at start-up
        raise ConfigError(f"GGUF tensor {t.name}: columns {cols.start}..{cols.stop} do not fall on its "
                          f"{block}-column blocks")
    return unpack(t.type_id, raw[:, cols.start // block * size:cols.stop // block * size].contiguous(), len(cols))


def _concat(items: list) -> object:
    if isinstance(items[0], torch.Tensor):
        return torch.cat(items)
    offsets = [c.offset for c in items]
    return Codes(torch.cat([c.q for c in items]), torch.cat([c.scale for c in items]),
                 None if offsets[0] is None else torch.cat(offsets), items[0].group)


class GGUFMethod(QuantMethod):
    name = "gguf"

    def __init__(self, path: str):
        self.path = path

    def check(self, config: ModelConfig, tp_size: int) -> None:
        """A row-parallel projection (o_proj, down_proj) gives each rank a run of input columns: it must be whole
        blocks of the tensor's type (32 columns for Q4_0/Q4_1/Q8_0, 256 for the Q4_K/Q6_K super-blocks), which
        are not split. Refused at start-up naming the tensor, its columns, the block and --tp-size."""
        if tp_size == 1:
            return
        from tandem.common.model.parallel.layers import TPShard

        read = GGUFReader.open(self.path, config)
        for rank in range(tp_size):
            for name, source in linear_sources(config, TPShard(rank, tp_size)).items():
                if source.cols is None:
                    continue
                tensor = f"{source.module}.weight"
                block, cols = _block(read, tensor), source.cols
                if cols.start % block or len(cols) % block:
                    t = read.tensor(tensor)
                    raise ConfigError(
                        f"--tp-size {tp_size}: GGUF tensor {t.name} ({tensor}, {read.type_of(tensor)}) has "
                        f"{t.shape[1]} input columns; a rank of this row-parallel projection takes {len(cols)} "
                        f"(from column {cols.start}), not whole {block}-column blocks: GGUF blocks are not split "
                        "across ranks; use a --tp-size whose share is a multiple of the block")

    def quantizes(self, module_name: str) -> bool:
        return True  # an untied LM head (output.weight) is quantized in the file too

    def build(self, read: CheckpointReader, source: LinearSource, dtype: torch.dtype,
              device: torch.device) -> QuantizedLinear:
        if not isinstance(read, GGUFReader):
            raise ConfigError(f"quant_method gguf needs a .gguf file, got {read.path!r}")
        names = [f"{module}.weight" for module, _ in source.parts]
        types = [read.type_of(n) for n in names]
        parts = [_read(read, n, rows, source.cols) for n, (_, rows) in zip(names, source.parts)]
        if len(set(types)) == 1:
            return _linear(_concat(parts), types[0], dtype, device, source.bias)
        return StackedLinear([_linear(p, t, dtype, device, False) for p, t in zip(parts, types)],
                             dtype, source.bias, device)

    def table(self, read: GGUFReader, name: str, rows: Optional[range], pad_to: int, dtype: torch.dtype,
              device: torch.device) -> QuantizedLinear:
        """A vocabulary table (the token embedding, or an untied LM head) as a quantized projection, rows = tokens:
        all of them, or a vocab-parallel rank's `rows` zero-padded to `pad_to`. 4-bit tables keep int8 codes
        (GroupedLinear), so a lookup indexes rows directly; an LM head that only multiplies takes the int4 kernel."""
        int4 = name == "lm_head.weight"
        return _linear(_read(read, name, rows, pad_to=pad_to), read.type_of(name), dtype, device, False, int4=int4)

    def quantize_embeddings(self, model: nn.Module, config: ModelConfig, read: CheckpointReader,
                            dtype: torch.dtype, device: torch.device, shard=None) -> None:
        """Swap the token embedding (and the LM head, when the projections left it: tied, or any under tensor
        parallelism) for the file's quantized table. Under tensor parallelism (`shard`) each rank keeps its
        vocabulary rows, quantized, the last rank's padding as zero rows; the LM head (tied: the same table;
        untied: output.weight's same rows) keeps its all-gather hook, which assembles the vocabulary."""
        inner = getattr(model, "model", None)
        embed = getattr(inner, "embed_tokens", None)
        has_embed = isinstance(embed, nn.Embedding)
        head = getattr(model, "lm_head", None)
        has_head = head is not None and not isinstance(head, QuantizedLinear)
        if not (has_embed or has_head):
            return
        rows, per, start, group = None, 0, 0, None
        if shard is not None:
            rows, per = shard.vocab(config), shard.vocab_rows_per_rank(config)
            start, group = shard.rank * per, getattr(embed, "group", None)
        table = None
        if has_embed or config.tie_word_embeddings:
            table = self.table(read, "model.embed_tokens.weight", rows, per, dtype, device)
        if has_embed:
            inner.embed_tokens = QuantizedEmbedding(table, dtype, start, group)
        if has_head:
            if not config.tie_word_embeddings:
                table = self.table(read, "lm_head.weight", rows, per, dtype, device)
            table._forward_hooks.update(head._forward_hooks)
            model.lm_head = table

    def describe(self) -> str:
        return f"gguf ({self.path})"


def method_from_config(qconfig: dict, config: ModelConfig, online: bool) -> GGUFMethod:
    if online:
        raise ConfigError("--quantization gguf: GGUF is a file format; pass the .gguf file as --model")
    if not qconfig.get("file"):
        raise UnsupportedModelError("quant_method gguf without a file: GGUF models are read from a .gguf file")
    return GGUFMethod(qconfig["file"])
