"""Quantized weights: the contract between the loader and each format (FP8, AWQ/GPTQ int4, GGUF, online int8).

The loader builds the model with plain `cpu_linear.Linear` projections, then asks the checkpoint's QuantMethod
(`resolve_method`) to build a QuantizedLinear for every projection it quantizes, straight from the checkpoint's
quantized tensors (never through a full-precision copy of the weight), and swaps it in. Each projection of ours is
described by a LinearSource: the HF modules stacked along its output features (q, k and v; gate and up), the
output rows this tensor-parallel rank takes of each, and the input columns it takes (row-parallel). Parameters that
stay unquantized (norms, biases, embeddings the format leaves alone) are filled by the loader as before.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
from torch import nn

from tandem.common.flags import ConfigError
from tandem.common.model.config import ModelConfig

# quant_method (config.json quantization_config.quant_method, "gguf" for a .gguf file, or an online --quantization)
# -> the module defining `method_from_config(qconfig, config, online) -> QuantMethod`.
_METHOD_MODULES = {
    "fp8": "tandem.common.model.quant.fp8",
    "compressed-tensors": "tandem.common.model.quant.fp8",
    "int8": "tandem.common.model.quant.fp8",
    "awq": "tandem.common.model.quant.int4",
    "gptq": "tandem.common.model.quant.int4",
    "gguf": "tandem.common.model.quant.gguf",
}
ONLINE_METHODS = ("fp8", "int8")


class CheckpointReader(Protocol):
    """What a QuantMethod reads tensors through (loader._WeightReader, or the GGUF reader): `get` marks the tensor
    used, so the loader's unused-tensor warning stays right."""

    path: str

    def shape(self, name: str) -> list[int]: ...

    def get(self, name: str, dim: int = 0, part: Optional[range] = None) -> torch.Tensor: ...

    def has(self, name: str) -> bool: ...


@dataclass(frozen=True)
class LinearSource:
    """One projection of ours in HF terms. `parts`: (HF module prefix, output rows this rank takes of it or None
    for all), stacked along the output features in this order; `cols`: the input columns this rank takes (None:
    all); `bias`: whether the parts carry a bias (filled by the loader, not the QuantMethod)."""

    parts: tuple[tuple[str, Optional[range]], ...]
    cols: Optional[range] = None
    bias: bool = False

    @property
    def module(self) -> str:
        return self.parts[0][0]


class QuantizedLinear(nn.Module):
    """A projection whose weight is held quantized: forward(x) = x @ W.T + bias, with W dequantized inside the
    GEMM (or by block inside the forward), never kept in full precision. Quantized tensors are buffers, so the
    loader's parameter filling skips them; `bias` (optional) is a parameter the loader fills. Forward hooks
    (tensor-parallel all-reduce, LoRA) see the inputs and outputs nn.Linear's would."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in float32, as the format defines it (tests, weight reads)."""

    def resident_bytes(self) -> int:
        """Bytes this projection keeps in memory (quantized data, scales, any packed copy, bias)."""
        return sum(t.numel() * t.element_size() for t in list(self.buffers()) + list(self.parameters()))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class QuantMethod(ABC):
    """A quantized format: what it quantizes and how a projection is read from the checkpoint."""

    name: str = ""

    def check(self, config: ModelConfig, tp_size: int) -> None:
        """Refuse at start-up (ConfigError naming the setting) what this format cannot run: a group size that the
        tensor-parallel slices split, a bit width, a model part it does not support."""

    def quantizes(self, module_name: str) -> bool:
        """Whether our projection `module_name` (e.g. model.layers.3.self_attn.qkv_proj) is quantized."""
        return not module_name.startswith("lm_head")

    @abstractmethod
    def build(self, read: CheckpointReader, source: LinearSource, dtype: torch.dtype,
              device: torch.device) -> QuantizedLinear:
        """The quantized projection for `source`, read from the checkpoint, computing in `dtype` on `device`."""

    def quantize_embeddings(self, model: nn.Module, config: ModelConfig, read: CheckpointReader,
                            dtype: torch.dtype, device: torch.device, shard=None) -> None:
        """A format that keeps the token embedding (and a tied LM head) quantized swaps them here (GGUF), for the
        whole model or one tensor-parallel rank (`shard`: its vocabulary rows); the others leave them to the
        loader."""

    def describe(self) -> str:
        """One line for the start-up log: the format and its settings."""
        return self.name


def resolve_method(quantization_config: Optional[dict[str, Any]], config: ModelConfig,
                   online: Optional[str] = None) -> Optional[QuantMethod]:
    """The QuantMethod of a checkpoint (its config.json `quantization_config`, or a GGUF file's synthesized one),
    or of an online `--quantization` over an unquantized checkpoint; None for an unquantized model. A quantized
    checkpoint with a different --quantization, or an unknown method, is a ConfigError naming it."""
    if quantization_config:
        name = str(quantization_config.get("quant_method", ""))
        if online is not None and online != name:
            raise ConfigError(f"--quantization {online}: the checkpoint is already quantized with {name!r} "
                              "(quantization_config.quant_method); drop the flag or pass that method")
        if name not in _METHOD_MODULES:
            raise ConfigError(f"quantization_config.quant_method {name!r} is not supported; supported: "
                              f"{', '.join(sorted(_METHOD_MODULES))}")
        module = importlib.import_module(_METHOD_MODULES[name])
        return module.method_from_config(quantization_config, config, online=False)
    if online is None:
        return None
    if online not in ONLINE_METHODS:
        raise ConfigError(f"--quantization {online!r} is not supported; online methods: {', '.join(ONLINE_METHODS)} "
                          "(pre-quantized checkpoints carry their method in config.json)")
    module = importlib.import_module(_METHOD_MODULES[online])
    return module.method_from_config({"quant_method": online}, config, online=True)


def linear_sources(config: ModelConfig, shard=None) -> dict[str, LinearSource]:
    """Our dense projections (attention and dense MLP of every layer, and the LM head when untied) -> their
    LinearSource, for the whole model or one tensor-parallel rank (`shard`: parallel.layers.TPShard)."""
    hd = config.head_dim
    if shard is None:
        q_rows = kv_rows = mlp = None
        q_cols = mlp_cols = None
    else:
        q, kv = shard.q_heads(config), shard.kv_heads(config)
        q_rows, kv_rows = range(q.start * hd, q.stop * hd), range(kv.start * hd, kv.stop * hd)
        mlp = shard.intermediate(config)
        q_cols, mlp_cols = q_rows, mlp
    out: dict[str, LinearSource] = {}
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        attn = f"{p}.self_attn"
        out[f"{attn}.qkv_proj"] = LinearSource(
            ((f"{attn}.q_proj", q_rows), (f"{attn}.k_proj", kv_rows), (f"{attn}.v_proj", kv_rows)),
            bias=config.attention_bias)
        out[f"{attn}.o_proj"] = LinearSource(((f"{attn}.o_proj", None),), cols=q_cols)
        if not config.is_moe_layer(i):
            out[f"{p}.mlp.gate_up_proj"] = LinearSource(((f"{p}.mlp.gate_proj", mlp), (f"{p}.mlp.up_proj", mlp)))
            out[f"{p}.mlp.down_proj"] = LinearSource(((f"{p}.mlp.down_proj", None),), cols=mlp_cols)
    if not config.tie_word_embeddings and shard is None:
        out["lm_head"] = LinearSource((("lm_head", None),))
    return out


def quantize_model(model: nn.Module, method: QuantMethod, config: ModelConfig, read: CheckpointReader,
                   shard, dtype: torch.dtype, device: torch.device) -> int:
    """Swap every projection `method` quantizes for its QuantizedLinear read from the checkpoint (keeping the
    forward hooks already on it: tensor parallelism's collectives). Returns how many were swapped. A projection
    the model does not have (another pipeline stage's layer) is skipped."""
    swapped = 0
    for name, source in linear_sources(config, shard).items():
        if not method.quantizes(name):
            continue
        try:
            old = model.get_submodule(name)
        except AttributeError:
            continue
        new = method.build(read, source, dtype, device)
        if (new.in_features, new.out_features) != (old.in_features, old.out_features):
            raise ConfigError(f"{method.name}: {name} reads as {new.out_features}x{new.in_features} from the "
                              f"checkpoint, the model expects {old.out_features}x{old.in_features}")
        new._forward_hooks.update(old._forward_hooks)
        new._forward_pre_hooks.update(old._forward_pre_hooks)
        model.set_submodule(name, new)
        swapped += 1
    method.quantize_embeddings(model, config, read, dtype, device, shard)
    return swapped


def quantized_linears(model: nn.Module) -> list[tuple[str, QuantizedLinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]


def weight_bytes(model: nn.Module) -> int:
    """Resident bytes of the model's weights: its parameters (a tied one once) and its quantized projections'
    buffers (not the oneDNN-packed copies of the unquantized linears, cpu_linear.py)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + sum(b.numel() * b.element_size() for _, m in quantized_linears(model) for b in m.buffers())


def bf16_weight_bytes(model: nn.Module) -> int:
    """What the same weights take in bfloat16: the baseline the quantized formats are measured against."""
    quantized = sum(m.in_features * m.out_features for _, m in quantized_linears(model))
    return 2 * (sum(p.numel() for p in model.parameters()) + quantized)


def write_dequantized(model: nn.Module, config: ModelConfig, src: str, dst: str) -> str:
    """The reference of a quantized `model` (loaded whole from the safetensors checkpoint `src`): the same
    checkpoint in `dst` as a plain float32 HF one, each quantized projection's weight replaced by its dequantized
    rows, its quantized tensors and scales dropped, quantization_config removed. transformers runs it."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = {n: t for f in sorted(os.listdir(src)) if f.endswith(".safetensors")
               for n, t in load_file(os.path.join(src, f)).items()}
    for name, source in linear_sources(config).items():
        module = model.get_submodule(name)
        if not isinstance(module, QuantizedLinear):
            continue
        weight, start = module.dequantize(), 0
        for prefix, _ in source.parts:
            for key in [k for k in tensors if k.startswith(prefix + ".") and k != prefix + ".bias"]:
                del tensors[key]
            rows = _part_rows(config, prefix)
            tensors[f"{prefix}.weight"] = weight[start:start + rows].contiguous()
            start += rows
    os.makedirs(dst, exist_ok=True)
    for fname in os.listdir(src):
        if fname != "config.json" and not fname.endswith(".safetensors") and fname != "model.safetensors.index.json":
            shutil.copy(os.path.join(src, fname), os.path.join(dst, fname))
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        hf = json.load(f)
    hf.pop("quantization_config", None)
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump({**hf, "torch_dtype": "float32"}, f, indent=2, sort_keys=True)
    save_file({n: t.float().contiguous() for n, t in tensors.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    return dst


def _part_rows(config: ModelConfig, prefix: str) -> int:
    """Output rows of one HF projection of the whole model."""
    kind = prefix.rsplit(".", 1)[1]
    return {"q_proj": config.num_heads * config.head_dim, "k_proj": config.num_kv_heads * config.head_dim,
            "v_proj": config.num_kv_heads * config.head_dim, "o_proj": config.hidden_size,
            "gate_proj": config.intermediate_size, "up_proj": config.intermediate_size,
            "down_proj": config.hidden_size, "lm_head": config.vocab_size}[kind]
