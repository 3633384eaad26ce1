"""AWQ and GPTQ int4 checkpoints (w4a16): their config and packed tensors, read into one form the kernels share.

Formats (what AutoAWQ and GPTQModel / AutoGPTQ write; w = (q - z) * s, q and z 4-bit):
- AWQ GEMM: `qweight` int32 [K, N/8] packed along N, nibble i of each int32 holding column 8c + AWQ_ORDER[i];
  `qzeros` int32 [K/G, N/8] packed the same way; `scales` fp16 [K/G, N]. Group of input column k: k // G.
- GPTQ: `qweight` int32 [K/8, N] packed along K in order (nibble i of row r is input column 8r + i); `qzeros`
  int32 [K/G, N/8] packed along N in order; `scales` fp16 [K/G, N]; `g_idx` int32 [K], the group of each input
  column (act-order / desc_act scatters them). checkpoint_format `gptq` (v1) stores z - 1 (read back + 1, so a
  zero of 0 reads as 16, as every v1 reader does); `gptq_v2` stores z.

Each projection is read into an Int4Weight (q unpacked to uint8, per-group scales and zeros, the group of every
input column), then handed to the CPU kernel (int4_cpu) or, on CUDA, the Triton kernel (int4_triton). A fused
projection (q/k/v, gate/up) concatenates its parts along N when they share g_idx, else runs one GEMM per part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from tandem.common.flags import ConfigError
from tandem.common.model.config import ModelConfig
from tandem.common.model.quant.base import CheckpointReader, LinearSource, QuantizedLinear, QuantMethod, linear_sources

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column 8c + AWQ_ORDER[i]
_AWQ_NIBBLE_OF_COLUMN = tuple(AWQ_ORDER.index(j) for j in range(8))
PACK = 8  # 4-bit values per int32
# The CPU kernel's group sizes are 32, 64, 128 and 256: a group size must be a multiple of 32 (or -1).
MIN_GROUP = 32


@dataclass
class Int4Weight:
    """One projection (or part of one) in the form both kernels start from. q uint8 [K, N] (0..15); scales float32
    [groups, N]; zeros uint8 [groups, N] (0..16); g_idx int64 [K], the group of each input column (the checkpoint's
    group ids: a tensor-parallel slice keeps every group's row); group_size: input columns per group."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    group_size: int

    @property
    def in_features(self) -> int:
        return self.q.shape[0]

    @property
    def out_features(self) -> int:
        return self.q.shape[1]

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: (q - z) * s of each column's group."""
        z, s = self.zeros[self.g_idx].float(), self.scales[self.g_idx]
        return ((self.q.float() - z) * s).T.contiguous()

    @staticmethod
    def cat(parts: list["Int4Weight"]) -> "Int4Weight":
        """Parts with the same g_idx stacked along N (output features)."""
        return Int4Weight(torch.cat([p.q for p in parts], 1), torch.cat([p.scales for p in parts], 1),
                          torch.cat([p.zeros for p in parts], 1), parts[0].g_idx, parts[0].group_size)


def unpack_along_n(packed: torch.Tensor, awq_order: bool) -> torch.Tensor:
    """int32 [R, C/8] -> uint8 [R, C]; awq_order: AWQ's interleaved nibbles, else nibble i is column 8c + i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, C/8, nibble]
    if awq_order:
        nibbles = nibbles[..., list(_AWQ_NIBBLE_OF_COLUMN)]
    return nibbles.reshape(packed.shape[0], -1).to(torch.uint8)


def unpack_along_k(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R/8, C] (GPTQ qweight) -> uint8 [R, C]; nibble i of row r is row 8r + i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed.unsqueeze(1) >> shifts.view(1, -1, 1)) & 0xF  # [R/8, nibble, C]
    return nibbles.reshape(-1, packed.shape[1]).to(torch.uint8)


def _words(nibbles: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words from 8 nibbles along `dim` (nibble i in bits 4i..4i+3), bit 31 wrapped as int32 does."""
    shape = [1] * nibbles.dim()
    shape[dim] = PACK
    words = (nibbles.long() << torch.arange(0, 32, 4).view(shape)).sum(dim)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def pack_along_n(q: torch.Tensor, awq_order: bool) -> torch.Tensor:
    """uint8 [R, C] -> int32 [R, C/8]; the inverse of unpack_along_n."""
    nibbles = q.view(q.shape[0], -1, PACK)
    return _words(nibbles[..., list(AWQ_ORDER)] if awq_order else nibbles, 2)


def pack_along_k(q: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C] -> int32 [R/8, C]; the inverse of unpack_along_k."""
    return _words(q.view(-1, PACK, q.shape[1]), 1)


@dataclass(frozen=True)
class Int4Config:
    """quantization_config of an AWQ or GPTQ checkpoint, checked."""

    method: str  # awq | gptq
    group_size: int  # -1: one group per output channel (GPTQ)
    desc_act: bool = False
    sym: bool = False  # described only: both formats store their zeros (8 when sym), read as they are
    zeros_minus_one: bool = False  # GPTQ checkpoint_format gptq (v1)
    not_converted: tuple[str, ...] = ()  # AWQ modules_to_not_convert

    @staticmethod
    def parse(qconfig: dict[str, Any]) -> "Int4Config":
        method = str(qconfig.get("quant_method"))
        bits = qconfig.get("bits", qconfig.get("w_bit"))
        if bits != 4:
            raise ConfigError(f"{method}: quantization_config.bits {bits!r} is not supported (int4 only)")
        group = qconfig.get("group_size", qconfig.get("q_group_size"))
        if not isinstance(group, int) or not (group == -1 or (group > 0 and group % MIN_GROUP == 0)):
            raise ConfigError(f"{method}: quantization_config.group_size {group!r} is not supported: the CPU "
                              f"kernel runs groups that are multiples of {MIN_GROUP} (or -1, per channel)")
        if method == "awq":
            return Int4Config("awq", _awq_group(group), not_converted=_awq_checks(qconfig))
        fmt = qconfig.get("checkpoint_format", qconfig.get("format", "gptq"))
        if fmt not in ("gptq", "gptq_v2"):
            raise ConfigError(f"gptq: quantization_config.checkpoint_format {fmt!r} is not supported "
                              "(gptq or gptq_v2)")
        if qconfig.get("lm_head"):
            raise ConfigError("gptq: quantization_config.lm_head true (a quantized LM head) is not supported")
        if qconfig.get("dynamic"):
            raise ConfigError("gptq: quantization_config.dynamic (per-module overrides) is not supported")
        return Int4Config("gptq", group, desc_act=bool(qconfig.get("desc_act", False)),
                          sym=bool(qconfig.get("sym", True)), zeros_minus_one=fmt == "gptq")


def _awq_group(group: int) -> int:
    if group == -1:
        raise ConfigError("awq: quantization_config.group_size -1 is not supported (AWQ groups are 32-128)")
    return group


def _awq_checks(qconfig: dict[str, Any]) -> tuple[str, ...]:
    version = str(qconfig.get("version", "gemm")).lower()
    if version != "gemm":
        raise ConfigError(f"awq: quantization_config.version {version!r} is not supported (only gemm: the "
                          "gemv, marlin and exllama layouts pack differently)")
    if not qconfig.get("zero_point", True):
        raise ConfigError("awq: quantization_config.zero_point false is not supported")
    return tuple(qconfig.get("modules_to_not_convert") or ())


class Int4Method(QuantMethod):
    """AWQ (GEMM) or GPTQ int4 weights; CPU: int4_cpu, CUDA: int4_triton."""

    def __init__(self, cfg: Int4Config):
        self.cfg = cfg
        self.name = cfg.method

    def describe(self) -> str:
        c = self.cfg
        extra = f", desc_act={c.desc_act}, sym={c.sym}, format={'v1' if c.zeros_minus_one else 'v2'}" \
            if c.method == "gptq" else ""
        return f"{c.method} int4 (group_size={c.group_size}{extra})"

    def quantizes(self, module_name: str) -> bool:
        if module_name.startswith("lm_head"):
            return False
        hf = _hf_names(module_name)
        skipped = [n for n in hf if any(m in n for m in self.cfg.not_converted)]
        if skipped and len(skipped) != len(hf):
            raise ConfigError(f"awq: modules_to_not_convert leaves {skipped} unquantized but not the rest of "
                              f"the fused {module_name} ({hf})")
        return not skipped

    def check(self, config: ModelConfig, tp_size: int) -> None:
        if config.moe is not None:
            raise ConfigError(f"{self.name}: quantized MoE checkpoints are not supported (dense models only)")
        group = self.cfg.group_size
        for name, source in linear_sources(config).items():
            if group > 0 and name != "lm_head" and _in_features(config, name) % group:
                raise ConfigError(f"{self.name}: quantization_config.group_size {group} does not divide {name}'s "
                                  f"{_in_features(config, name)} input features")
        if tp_size > 1:
            self._check_tp(config, tp_size)

    def _check_tp(self, config: ModelConfig, tp_size: int) -> None:
        """Packed int32s hold 8 values, so every rank's slice must start on a multiple of 8; without act-order its
        input columns must also be whole groups (act-order's groups are scattered: each rank pads its partial
        groups, see int4_cpu)."""
        from tandem.common.model.parallel.layers import TPShard

        group = self.cfg.group_size
        whole_groups = group > 0 and not self.cfg.desc_act
        for rank in range(tp_size):
            for name, source in linear_sources(config, TPShard(rank, tp_size)).items():
                for part, rows in source.parts:
                    if rows is not None and (rows.start % PACK or rows.stop % PACK):
                        raise ConfigError(f"{self.name} at --tp-size {tp_size}: {part} rank {rank} takes output "
                                          f"rows {rows.start}-{rows.stop}, not on the 8-row packing")
                cols = source.cols
                if cols is None:
                    continue
                step = group if whole_groups else PACK
                if cols.start % step or cols.stop % step:
                    what = f"quantization_config.group_size {group}" if whole_groups else "the 8-column packing"
                    raise ConfigError(f"{self.name} at --tp-size {tp_size}: {name} rank {rank} takes input columns "
                                      f"{cols.start}-{cols.stop} ({len(cols)} a rank), not whole groups of {what}")

    def build(self, read: CheckpointReader, source: LinearSource, dtype: torch.dtype,
              device: torch.device) -> QuantizedLinear:
        parts = [self.read_part(read, prefix, rows, source.cols) for prefix, rows in source.parts]
        return Int4Linear(parts, source.bias, dtype, device)

    def read_part(self, read: CheckpointReader, prefix: str, rows: Optional[range],
                  cols: Optional[range]) -> Int4Weight:
        """One HF module's int4 weight, its output rows `rows` and input columns `cols` (None: all)."""
        packed_rows = None if rows is None else range(rows.start // PACK, rows.stop // PACK)
        if self.cfg.method == "awq":
            q = unpack_along_n(_read(read, f"{prefix}.qweight", 1, packed_rows, cols), awq_order=True)
            zeros = unpack_along_n(_read(read, f"{prefix}.qzeros", 1, packed_rows, None), awq_order=True)
            k_full = read.shape(f"{prefix}.qweight")[0]
        else:
            k_part = None if cols is None else range(cols.start // PACK, cols.stop // PACK)
            q = unpack_along_k(_read(read, f"{prefix}.qweight", 1, rows, k_part))
            zeros = unpack_along_n(_read(read, f"{prefix}.qzeros", 1, packed_rows, None), awq_order=False)
            if self.cfg.zeros_minus_one:
                zeros = zeros + 1
            k_full = read.shape(f"{prefix}.qweight")[0] * PACK
        scales = _read(read, f"{prefix}.scales", 1, rows, None).float()
        groups = scales.shape[0]
        group_size = k_full // groups
        if self.cfg.group_size > 0 and group_size != self.cfg.group_size:
            raise ConfigError(f"{self.name}: {prefix} has {groups} groups over {k_full} input features, not "
                              f"quantization_config.group_size {self.cfg.group_size}")
        g_idx = self._g_idx(read, prefix, k_full, group_size)
        if cols is not None:
            g_idx = g_idx[cols.start:cols.stop]
        return Int4Weight(q, scales, zeros, g_idx, group_size)

    def _g_idx(self, read: CheckpointReader, prefix: str, k_full: int, group_size: int) -> torch.Tensor:
        name = f"{prefix}.g_idx"
        if self.cfg.method == "gptq" and read.has(name):
            g_idx = read.get(name).long()
            if g_idx.shape != (k_full,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= k_full // group_size:
                raise ConfigError(f"{self.name}: {name} is not {k_full} group ids below {k_full // group_size}")
            return g_idx
        if self.cfg.desc_act:
            raise ConfigError(f"{self.name}: quantization_config.desc_act true but {name} is missing")
        return torch.arange(k_full) // group_size


def _read(read: CheckpointReader, name: str, n_dim: int, n_part: Optional[range],
          k_part: Optional[range]) -> torch.Tensor:
    """The tensor's slice `n_part` along its output-feature dim `n_dim` and `k_part` along the other."""
    k_dim = 1 - n_dim
    if n_part is not None:
        t = read.get(name, n_dim, n_part)
        return t if k_part is None else t.narrow(k_dim, k_part.start, len(k_part))
    if k_part is not None:
        return read.get(name, k_dim, k_part)
    return read.get(name)


def _hf_names(module_name: str) -> list[str]:
    if module_name.endswith("qkv_proj"):
        base = module_name[:-len("qkv_proj")]
        return [f"{base}{p}_proj" for p in "qkv"]
    if module_name.endswith("gate_up_proj"):
        base = module_name[:-len("gate_up_proj")]
        return [f"{base}gate_proj", f"{base}up_proj"]
    return [module_name]


def _in_features(config: ModelConfig, name: str) -> int:
    if name.endswith("o_proj"):
        return config.num_heads * config.head_dim
    if name.endswith("down_proj"):
        return config.intermediate_size
    return config.hidden_size


class Int4Linear(QuantizedLinear):
    """A projection of int4 parts: one GEMM over parts that share g_idx (stacked along N), else one per part,
    outputs concatenated. Kernels: int4_cpu.CpuInt4Gemm, or int4_triton.TritonInt4Gemm on CUDA."""

    def __init__(self, parts: list[Int4Weight], bias: bool, dtype: torch.dtype, device: torch.device):
        k = parts[0].in_features
        if any(p.in_features != k for p in parts):
            raise ConfigError(f"int4: fused parts disagree on input features: {[p.in_features for p in parts]}")
        super().__init__(k, sum(p.out_features for p in parts), bias, dtype, device)
        same = all(torch.equal(p.g_idx, parts[0].g_idx) and p.scales.shape[0] == parts[0].scales.shape[0]
                   for p in parts)
        groups = [Int4Weight.cat(parts)] if same else parts
        self.gemms = nn.ModuleList(_gemm(w, dtype, device) for w in groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        outs = [g(flat) for g in self.gemms]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([g.dequantize() for g in self.gemms], 0)


def _gemm(weight: Int4Weight, dtype: torch.dtype, device: torch.device) -> nn.Module:
    if device.type == "cuda":
        from tandem.common.model.quant.int4_triton import TritonInt4Gemm

        return TritonInt4Gemm(weight, dtype, device)
    from tandem.common.model.quant.int4_cpu import CpuInt4Gemm

    return CpuInt4Gemm(weight, dtype)


def method_from_config(qconfig: dict[str, Any], config: ModelConfig, online: bool) -> QuantMethod:
    if online:
        raise ConfigError(f"--quantization {qconfig.get('quant_method')}: int4 needs a pre-quantized checkpoint")
    return Int4Method(Int4Config.parse(qconfig))
