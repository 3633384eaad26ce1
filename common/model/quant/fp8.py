"""FP8 and int8 weights: FineGrainedFP8 / DeepSeek-V3 checkpoints (quant_method fp8), compressed-tensors float8
checkpoints, and online --quantization fp8|int8 of an unquantized checkpoint.

Weight-only: activations stay in the model's dtype (a checkpoint's `activation_scheme`, dynamic or static, and its
`input_scale`s are not applied), except the CUDA FP8 GEMM, which quantizes activations per token as FP8 GEMMs must.
Every format is held the same way (Fp8Linear): the float8_e4m3fn weight [out, in] and float32 scales [out, groups],
one row of scales per output row, a group of `group` input columns per scale. A per-tensor scale becomes a column of
equal per-row scales, so q, k and v (gate and up) with different per-tensor scales fuse exactly into one projection;
a 128x128 block scale is repeated over its block's 128 rows (4 bytes per 128 weights, 3 % over the FP8 bytes), so a
tensor-parallel rank can take any rows.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from tandem.common.flags import ConfigError
from tandem.common.model import cpu_gemm
from tandem.common.model.config import ModelConfig
from tandem.common.model.quant.base import CheckpointReader, LinearSource, QuantizedLinear, QuantMethod

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
INT8_MAX = 127
# Dequantized rows per step of a CPU forward: the scratch is at most this many rows, never the whole weight.
DEQUANT_ROWS = 128
STRATEGIES = ("tensor", "channel", "block")


def _fp8_gemm_device(device: torch.device) -> bool:
    """A CUDA GPU with FP8 tensor cores (compute capability 8.9: Ada, 9.0: Hopper, and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def dequantize_rows(weight: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """float32 weight rows from their FP8 (or int8) values and per-row scales [rows, groups] of `group` columns."""
    w = weight.to(torch.float32)
    if scale.shape[1] == 1:
        return w.mul_(scale)
    full, rem = divmod(w.shape[1], group)
    w[:, :full * group].unflatten(1, (full, group)).mul_(scale[:, :full, None])
    if rem:
        w[:, full * group:].mul_(scale[:, full:])
    return w


class Fp8Linear(QuantizedLinear):
    """x @ W.T + bias with W = weight (float8_e4m3fn) * weight_scale (per row, per `group` input columns)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, group: int, bias: bool, dtype: torch.dtype,
                 device: torch.device):
        super().__init__(weight.shape[1], weight.shape[0], bias, dtype, device)
        self.group = group
        # The CUDA FP8 GEMM takes one scale per row (per-tensor and per-channel checkpoints, not 128x128 blocks)
        # and sizes that are multiples of 16.
        self.fp8_gemm = _fp8_gemm_device(torch.device(device)) and scale.shape[1] == 1 and \
            not (self.in_features % 16 or self.out_features % 16)
        # On CPU, Tandem's GEMM kernel where it builds: the FP8 codes in its panels with float32 scales, each weight
        # widened and scaled in registers (w = fp8 * scale, rounded once, as dequantize_rows rounds it).
        self.ours = torch.device(device).type == "cpu" and bool(cpu_gemm.panel_widths())
        if self.ours:
            panels, sz = cpu_gemm.pack_fp8(weight, scale.float(), group)
            self.register_buffer("panels", panels)
            self.register_buffer("sz", sz)
            return
        self.register_buffer("weight", weight.to(device))
        self.register_buffer("weight_scale", scale.to(device=device, dtype=torch.float32).contiguous())

    def dequantize(self) -> torch.Tensor:
        if self.ours:
            return cpu_gemm.unpack_panels(self.panels, self.sz, self.out_features, self.group)
        return dequantize_rows(self.weight, self.weight_scale, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.ours:
            out = cpu_gemm.quant_linear(x2, self.panels, self.sz, self.out_features, self.group)
        elif self.fp8_gemm:
            out = _scaled_mm_rowwise(x2, self.weight, self.weight_scale)
        else:
            out = self._dequantized_linear(x2)
        if self.bias is not None:
            out += self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def _dequantized_linear(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T, W dequantized DEQUANT_ROWS output rows at a time. With one scale per row the FP8 values are
        widened only (exact in bfloat16, float16 and float32) and the scale multiplies the output instead."""
        out = x.new_empty(x.shape[0], self.out_features)
        per_row = self.weight_scale.shape[1] == 1
        for start in range(0, self.out_features, DEQUANT_ROWS):
            rows = slice(start, start + DEQUANT_ROWS)
            if per_row:
                out[:, rows] = F.linear(x, self.weight[rows].to(x.dtype)) * self.weight_scale[rows].t().to(x.dtype)
            else:
                w = dequantize_rows(self.weight[rows], self.weight_scale[rows], self.group)
                out[:, rows] = F.linear(x, w.to(x.dtype))
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group={self.group}"


def _scaled_mm_rowwise(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """CUDA FP8 GEMM: x quantized per token (dynamic), the weight per output row. Not verified here (no GPU)."""
    x_scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    xq = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.t(), out_dtype=x.dtype)


class Int8Linear(QuantizedLinear):
    """Weight-only int8, one scale per output row (in the model's dtype, as torch's CPU kernel wants it): on CPU
    Tandem's GEMM kernel where it builds (the codes in its 8-bit panels, one group of K columns a row), else torch's
    _weight_int8pack_mm (int8 weights widened inside the GEMM), elsewhere dequantized by rows."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: bool, dtype: torch.dtype,
                 device: torch.device):
        super().__init__(weight.shape[1], weight.shape[0], bias, dtype, device)
        self.ours = torch.device(device).type == "cpu" and bool(cpu_gemm.panel_widths())
        if self.ours:
            panels, sz = cpu_gemm.pack_int8(weight, scale.to(dtype).float()[:, None], None, self.in_features)
            self.register_buffer("panels", panels)
            self.register_buffer("sz", sz)
            return
        self.register_buffer("weight", weight.to(device))
        self.register_buffer("weight_scale", scale.to(device=device, dtype=dtype))

    def dequantize(self) -> torch.Tensor:
        if self.ours:
            return cpu_gemm.unpack_panels(self.panels, self.sz, self.out_features, self.in_features)
        return self.weight.float() * self.weight_scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.ours:
            out = cpu_gemm.quant_linear(x2, self.panels, self.sz, self.out_features, self.in_features)
        elif x2.is_cpu:
            out = torch.ops.aten._weight_int8pack_mm(x2.to(self.weight_scale.dtype).contiguous(), self.weight,
                                                     self.weight_scale).to(x.dtype)
        else:
            out = x2.new_empty(x2.shape[0], self.out_features)
            for start in range(0, self.out_features, DEQUANT_ROWS):
                rows = slice(start, start + DEQUANT_ROWS)
                w = self.weight[rows].to(x.dtype) * self.weight_scale[rows, None].to(x.dtype)
                out[:, rows] = F.linear(x2, w)
        if self.bias is not None:
            out += self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


# ---- quantizing full-precision rows (online, and `tandem model create --quantize`) --------------------------------

def quantize_fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-row FP8: (weight float8_e4m3fn, scale float32 [rows, 1]) with weight * scale ~= w."""
    w = w.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 as DeepSeek-V3 ships it: (weight float8_e4m3fn, weight_scale_inv float32 [ceil(rows/bn),
    ceil(cols/bk)]), each block's amax mapped to 448; weight * scale_inv (per block) ~= w."""
    bn, bk = block
    rows, cols = w.shape
    padded = F.pad(w.float(), (0, -cols % bk, 0, -rows % bn))
    blocks = padded.unflatten(0, (-1, bn)).unflatten(2, (-1, bk))  # [R, bn, C, bk]
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [R, C]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.flatten(2).flatten(0, 1)[:rows, :cols].contiguous(), scale


def quantize_int8_rows(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: (weight int8, scale [rows] in `dtype`), rounded against the stored scale."""
    scale = (w.float().abs().amax(dim=1) / INT8_MAX).clamp(min=1e-12).to(dtype)
    q = torch.round(w.float() / scale.float()[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


# ---- formats ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint stores its FP8 weights. `scale_name`: weight_scale_inv (FineGrainedFP8) or weight_scale
    (compressed-tensors, per-tensor fp8 of vLLM); `block`: (rows, cols) of a block scale, None for tensor/channel;
    `ignore`: HF module names (or `re:` patterns) left unquantized."""

    strategy: str
    scale_name: str
    block: Optional[tuple[int, int]] = None
    ignore: tuple[str, ...] = ()
    static_inputs: bool = False


class Fp8Checkpoint(QuantMethod):
    """A pre-quantized FP8 checkpoint: FineGrainedFP8 (quant_method fp8) or compressed-tensors float8."""

    def __init__(self, name: str, scheme: Fp8Scheme):
        self.name, self.scheme = name, scheme

    def check(self, config: ModelConfig, tp_size: int) -> None:
        _refuse_moe(self.name, config)
        if self.scheme.block is None or tp_size == 1:
            return
        bk = self.scheme.block[1]
        for what, size in (("num_attention_heads x head_dim", config.num_heads * config.head_dim),
                           ("intermediate_size", config.intermediate_size)):
            if (size // tp_size) % bk:
                raise ConfigError(
                    f"{self.name}: --tp-size {tp_size} splits {what} ({size}) into {size // tp_size} input columns "
                    f"per rank, not a multiple of the weight block's {bk} columns (weight_block_size "
                    f"{list(self.scheme.block)}): the row-parallel o_proj/down_proj slices would cut scale blocks")

    def quantizes(self, module_name: str) -> bool:
        return super().quantizes(module_name) and not any(_ignored(p, self.scheme.ignore)
                                                          for p in _hf_modules(module_name))

    def build(self, read: CheckpointReader, source: LinearSource, dtype: torch.dtype,
              device: torch.device) -> QuantizedLinear:
        pieces = [self._read_part(read, prefix, rows, source.cols) for prefix, rows in source.parts]
        weight = torch.cat([w for w, _, _ in pieces])
        scale = torch.cat([s for _, s, _ in pieces])
        return Fp8Linear(weight, scale, pieces[0][2], source.bias, dtype, device)

    def _read_part(self, read: CheckpointReader, prefix: str, rows: Optional[range],
                   cols: Optional[range]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One HF module's FP8 rows and columns, their per-row scales, and the scale group's width."""
        name = f"{prefix}.weight"
        out_features, in_features = read.shape(name)
        weight = read.get(name, 0, rows) if rows is not None else read.get(name, 1, cols)
        if rows is not None and cols is not None:
            weight = weight[:, cols.start:cols.stop]
        if weight.dtype != FP8:
            raise ConfigError(f"{self.name}: {name} is {weight.dtype}, not float8_e4m3fn; a module left "
                              "unquantized must be listed in modules_to_not_convert / ignore")
        if self.scheme.static_inputs and read.has(f"{prefix}.input_scale"):
            read.get(f"{prefix}.input_scale")  # read, not applied: activations stay unquantized
        rows = rows if rows is not None else range(out_features)
        scale = self._row_scales(read, prefix, out_features, in_features)[rows.start:rows.stop]
        if self.scheme.block is None:
            return weight, scale, weight.shape[1]
        bk = self.scheme.block[1]
        if cols is not None:
            if cols.start % bk or (cols.stop % bk and cols.stop != in_features):
                raise ConfigError(f"{self.name}: {name}'s input columns {cols.start}-{cols.stop} cut its "
                                  f"{bk}-column scale blocks")
            scale = scale[:, cols.start // bk:math.ceil(cols.stop / bk)]
        return weight, scale, bk

    def _row_scales(self, read: CheckpointReader, prefix: str, out_features: int, in_features: int) -> torch.Tensor:
        """The module's scales as float32 [out_features, groups]: one row per output row."""
        name = f"{prefix}.{self.scheme.scale_name}"
        if not read.has(name) and self.scheme.strategy == "tensor" and read.has(f"{prefix}.weight_scale"):
            name = f"{prefix}.weight_scale"  # per-tensor fp8 as vLLM / ModelOpt write it
        scale = read.get(name).float()
        if self.scheme.strategy == "tensor":
            if scale.numel() != 1:
                raise ConfigError(f"{self.name}: {name} has shape {list(scale.shape)}, expected one per-tensor scale")
            return scale.reshape(1, 1).expand(out_features, 1)
        if self.scheme.strategy == "channel":
            if scale.numel() != out_features:
                raise ConfigError(f"{self.name}: {name} has shape {list(scale.shape)}, expected [{out_features}, 1] "
                                  "(one scale per output channel)")
            return scale.reshape(out_features, 1)
        bn, bk = self.scheme.block
        expected = [math.ceil(out_features / bn), math.ceil(in_features / bk)]
        if list(scale.shape) != expected:
            raise ConfigError(f"{self.name}: {name} has shape {list(scale.shape)}, expected {expected} for a "
                              f"{out_features}x{in_features} weight in {bn}x{bk} blocks (weight_block_size)")
        return scale.repeat_interleave(bn, dim=0)[:out_features]

    def describe(self) -> str:
        s = self.scheme
        block = f" {s.block[0]}x{s.block[1]} blocks" if s.block else ""
        static = ", static input scales not applied (weight-only)" if s.static_inputs else ""
        return (f"{self.name} FP8 weights, per-{s.strategy}{block}{static}; activations in --dtype (per-token FP8 "
                "only inside a CUDA FP8 GEMM)")


class OnlineQuantization(QuantMethod):
    """--quantization fp8|int8 over an unquantized checkpoint: every projection quantized per output row as it is
    read, one HF module at a time (its full-precision rows are dropped once quantized)."""

    def __init__(self, name: str):
        self.name = name

    def check(self, config: ModelConfig, tp_size: int) -> None:
        _refuse_moe(f"--quantization {self.name}", config)

    def build(self, read: CheckpointReader, source: LinearSource, dtype: torch.dtype,
              device: torch.device) -> QuantizedLinear:
        weights, scales = [], []
        for prefix, rows in source.parts:
            # A row's scale comes from the whole row, so a row-parallel rank quantizes as the unsharded model does.
            w = read.get(f"{prefix}.weight", 0, rows) if rows is not None else read.get(f"{prefix}.weight")
            q, scale = quantize_fp8_rows(w) if self.name == "fp8" else quantize_int8_rows(w, dtype)
            del w
            if source.cols is not None:
                q = q[:, source.cols.start:source.cols.stop].contiguous()
            weights.append(q)
            scales.append(scale)
        weight, scale = torch.cat(weights), torch.cat(scales)
        if self.name == "fp8":
            return Fp8Linear(weight, scale, weight.shape[1], source.bias, dtype, device)
        return Int8Linear(weight, scale, source.bias, dtype, device)

    def describe(self) -> str:
        kernel = "dequantized by rows inside the linear on CPU" if self.name == "fp8" else \
            "_weight_int8pack_mm on CPU"
        return f"--quantization {self.name}: weight-only, per output channel, {kernel}"


def _refuse_moe(what: str, config: ModelConfig) -> None:
    if config.moe is not None:
        raise ConfigError(f"{what}: {config.architecture} is an MoE model; quantized experts are not supported "
                          "(FP8/int8 weights cover dense models)")


def _hf_modules(module_name: str) -> list[str]:
    """Our projection's HF modules: qkv_proj -> q/k/v_proj, gate_up_proj -> gate/up_proj."""
    if module_name.endswith(".qkv_proj"):
        base = module_name[:-len("qkv_proj")]
        return [f"{base}{p}_proj" for p in "qkv"]
    if module_name.endswith(".gate_up_proj"):
        base = module_name[:-len("gate_up_proj")]
        return [f"{base}gate_proj", f"{base}up_proj"]
    return [module_name]


def _ignored(hf_module: str, ignore: tuple[str, ...]) -> bool:
    """transformers' modules_to_not_convert matches a name or a prefix; compressed-tensors' ignore also `re:`."""
    for entry in ignore:
        if entry.startswith("re:"):
            if re.fullmatch(entry[3:], hf_module):
                return True
        elif hf_module == entry or hf_module.startswith(entry + ".") or hf_module.endswith("." + entry):
            return True
    return False


# ---- config.json quantization_config -> method --------------------------------------------------------------------

def method_from_config(qconfig: dict[str, Any], config: ModelConfig, online: bool) -> QuantMethod:
    name = qconfig.get("quant_method")
    if online:
        return OnlineQuantization(name)
    if name == "fp8":
        return Fp8Checkpoint("fp8", _fine_grained_scheme(qconfig))
    if name == "compressed-tensors":
        return Fp8Checkpoint("compressed-tensors", _compressed_tensors_scheme(qconfig))
    raise ConfigError(f"quantization_config.quant_method {name!r} is online only: pass --quantization {name} with "
                      "an unquantized checkpoint")


def _fine_grained_scheme(qconfig: dict[str, Any]) -> Fp8Scheme:
    """FineGrainedFP8 (transformers) / DeepSeek-V3: weight_block_size [128, 128] and weight_scale_inv, or no block
    size and one per-tensor scale."""
    fmt = qconfig.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"quantization_config.fmt {fmt!r}: only e4m3 (float8_e4m3fn) FP8 weights are supported")
    scheme = str(qconfig.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("dynamic", "static"):
        raise ConfigError(f"quantization_config.activation_scheme {scheme!r}: expected dynamic or static")
    ignore = tuple(qconfig.get("modules_to_not_convert") or qconfig.get("ignored_layers") or ())
    block = qconfig.get("weight_block_size")
    if block is None:
        return Fp8Scheme("tensor", "weight_scale_inv", None, ignore, scheme == "static")
    return Fp8Scheme("block", "weight_scale_inv", _block(block, "quantization_config.weight_block_size"), ignore,
                     scheme == "static")


def _block(block: Any, where: str) -> tuple[int, int]:
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"{where} {block!r}: expected [rows, columns] of positive integers, e.g. [128, 128]")
    return int(block[0]), int(block[1])


def _compressed_tensors_scheme(qconfig: dict[str, Any]) -> Fp8Scheme:
    """compressed-tensors with float 8-bit weights (llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK schemes)."""
    groups = qconfig.get("config_groups") or {}
    if not groups:
        raise ConfigError("compressed-tensors quantization_config has no config_groups")
    strategies, static = set(), False
    for gname, group in groups.items():
        weights = group.get("weights") or {}
        kind, bits = weights.get("type"), weights.get("num_bits")
        fmt = group.get("format") or qconfig.get("format")
        if (kind, bits) != ("float", 8) or fmt not in (None, "float-quantized", "naive-quantized"):
            raise ConfigError(f"compressed-tensors config_groups.{gname}: weights {kind} {bits}-bit (format {fmt}) "
                              "are not supported; only float 8-bit (FP8) weights (format float-quantized)")
        strategy = weights.get("strategy")
        if strategy not in STRATEGIES:
            raise ConfigError(f"compressed-tensors config_groups.{gname}.weights.strategy {strategy!r}: supported "
                              f"{', '.join(STRATEGIES)}")
        block = _block(weights.get("block_structure"), f"config_groups.{gname}.weights.block_structure") \
            if strategy == "block" else None
        strategies.add((strategy, block))
        inputs = group.get("input_activations") or {}
        static = static or (bool(inputs) and not inputs.get("dynamic", False))
    if len(strategies) > 1:
        raise ConfigError(f"compressed-tensors: config_groups mix weight strategies {sorted(map(str, strategies))}; "
                          "one strategy for every group is supported")
    (strategy, block), = strategies
    return Fp8Scheme(strategy, "weight_scale", block, tuple(qconfig.get("ignore") or ()), static)


# ---- writing FP8 checkpoints (tandem model create --quantize) ------------------------------------------------------

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _projection_weights(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in PROJECTIONS
            and ".experts." not in n]


def write_fp8_block(out_dir: str, tensors: dict[str, torch.Tensor], cfg: dict[str, Any],
                    block: tuple[int, int] = (128, 128)) -> dict[str, Any]:
    """FineGrainedFP8 as DeepSeek-V3 ships it: float8_e4m3fn `weight`, float32 `weight_scale_inv` per block."""
    from tandem.common.model.create import save_weights

    _refuse_moe_config(cfg)
    out = dict(tensors)
    for name in _projection_weights(tensors):
        out[name], out[name[:-len("weight")] + "weight_scale_inv"] = quantize_fp8_blocks(tensors[name], block)
    save_weights(out_dir, out)
    return {**cfg, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                           "weight_block_size": list(block)}}


def write_fp8_channel(out_dir: str, tensors: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, Any]:
    """compressed-tensors FP8_DYNAMIC as llm-compressor writes it: per-channel `weight_scale` [out, 1]."""
    from tandem.common.model.create import save_weights

    _refuse_moe_config(cfg)
    out = dict(tensors)
    for name in _projection_weights(tensors):
        out[name], out[name[:-len("weight")] + "weight_scale"] = quantize_fp8_rows(tensors[name])
    save_weights(out_dir, out)
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False,
               "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax"}
    inputs = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True,
              "group_size": None, "block_structure": None, "actorder": None, "observer": None}
    return {**cfg, "quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                      "output_activations": None, "format": "float-quantized"}}}}


def _refuse_moe_config(cfg: dict[str, Any]) -> None:
    if "num_experts" in cfg or "num_local_experts" in cfg:
        raise ValueError(f"--quantize: {cfg['model_type']} is an MoE model; FP8 checkpoints of MoE experts are not "
                         "supported")
