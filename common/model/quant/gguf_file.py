"""A GGUF file (llama.cpp's format) read as a HF checkpoint: ModelConfig from its metadata, tensors under HF names.

The file is memory-mapped (gguf.GGUFReader); a quantized tensor is handed out as its raw blocks, rows in HF order:
llama.cpp's converter permutes the rows of q_proj and k_proj for its rope, undone here as transformers' GGUF loader
undoes it (modeling_gguf_pytorch_utils.LlamaConverter._reverse_permute_weights).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from tandem.common.errors import UnsupportedModelError
from tandem.common.model.config import ModelConfig
from tandem.common.model.quant.gguf_quants import BLOCK_TYPES, FLOAT_TYPES, Codes, type_name, unpack

# GGUF architecture -> ours (the llama family: llama.cpp writes Mistral and Llama 3 as "llama").
_ARCHITECTURES = {"llama": "LlamaForCausalLM"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


@functools.lru_cache(maxsize=4)
def _open(path: str, size: int, mtime_ns: int):
    """One parse per file version and process: GGUFReader walks every metadata array (seconds for a vocabulary)."""
    from gguf import GGUFReader

    return GGUFReader(path)


def open_gguf(path: str):
    stat = os.stat(path)
    return _open(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)


def metadata(reader, key: str, default: Any = None) -> Any:
    field_ = reader.get_field(key)
    return default if field_ is None else field_.contents()


def hf_name(gguf_name: str) -> Optional[str]:
    """The HF tensor name of a llama GGUF tensor; None for one we do not map (rope_freqs)."""
    m = _LAYER.match(gguf_name)
    if m is not None:
        part = _LAYER_NAMES.get(m.group(2))
        return None if part is None else f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    stem, _, kind = gguf_name.rpartition(".")
    return f"{_TOP_NAMES[stem]}.{kind}" if stem in _TOP_NAMES else None


def config_from_gguf(path: str) -> ModelConfig:
    """The ModelConfig that transformers' GGUF loader derives for a llama-architecture file, with the quantization
    set to {"quant_method": "gguf", "file": path} so quant.base.resolve_method reads its weights through quant.gguf."""
    reader = open_gguf(path)
    arch = metadata(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedModelError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                                    f"{', '.join(_ARCHITECTURES)}")

    def get(key: str, default: Any = None) -> Any:
        return metadata(reader, f"{arch}.{key}", default)

    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise UnsupportedModelError(f"{path}: rope_freqs.weight (Llama 3.1-style rope frequency factors) is not "
                                    "supported in GGUF files")
    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size") or len(reader.get_field("tokenizer.ggml.tokens").data)
    eos = metadata(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=_ARCHITECTURES[arch], model_type=arch, vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")), num_layers=int(get("block_count")),
        num_heads=num_heads, num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(get("attention.key_length") or get("rope.dimension_count") or hidden // num_heads),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=_rope_scaling(path, get),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=metadata(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
        # the weights stay quantized; activations and the KV cache follow --dtype. auto: bfloat16, half the bytes of
        # activations and KV cache (Tandem's 4-bit kernel runs float32 as fast where it builds; torch's int4
        # kernel, elsewhere, is tens of times slower in float32; docs/quantization.md, GGUF)
        torch_dtype="bfloat16",
        quantization={"quant_method": "gguf", "file": path},
    )


def _rope_scaling(path: str, get) -> Optional[dict[str, Any]]:
    kind = get("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise UnsupportedModelError(f"{path}: rope.scaling.type {kind!r} is not supported in GGUF files (linear)")
    return {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}


@dataclass
class GGUFTensor:
    name: str  # the GGUF name
    type_id: int
    shape: list[int]  # HF order: [rows, cols] for a matrix
    data: np.ndarray  # memory-mapped: [rows, bytes per row] for block types, the values for float ones
    heads: int = 0  # q_proj/k_proj: the head count llama.cpp permuted the rows by (0: not permuted)

    def row_order(self) -> Optional[torch.Tensor]:
        """HF row r is GGUF row order[r] (None: the same): rows h*2d + i*2 + j of a head go to h*2d + j*d + i."""
        if not self.heads:
            return None
        half = self.shape[0] // self.heads // 2
        return torch.arange(self.shape[0]).view(self.heads, half, 2).transpose(1, 2).reshape(-1)


@dataclass
class GGUFReader:
    """The CheckpointReader (quant/base.py) of a GGUF file, under HF tensor names. `get` gives float32 values
    (norms; tests); a QuantMethod reads projections through `codes` or `raw`, without a float copy."""

    path: str
    config: ModelConfig
    where: dict[str, GGUFTensor] = field(default_factory=dict)
    used: set[str] = field(default_factory=set)

    @classmethod
    def open(cls, path: str, config: ModelConfig) -> "GGUFReader":
        reader = cls(path, config)
        for t in open_gguf(path).tensors:
            name = hf_name(t.name)
            if name is None:
                continue
            heads = 0
            if name.endswith("self_attn.q_proj.weight"):
                heads = config.num_heads
            elif name.endswith("self_attn.k_proj.weight"):
                heads = config.num_kv_heads
            shape = [int(n) for n in reversed(t.shape.tolist())]
            reader.where[name] = GGUFTensor(t.name, int(t.tensor_type), shape, t.data, heads)
        return reader

    def tensor(self, name: str) -> GGUFTensor:
        if name not in self.where:
            from tandem.common.model.loader import WeightLoadError

            raise WeightLoadError(f"GGUF file {self.path!r} is missing weight {name!r}")
        return self.where[name]

    def shape(self, name: str) -> list[int]:
        return list(self.tensor(name).shape)

    def has(self, name: str) -> bool:
        return name in self.where

    def type_of(self, name: str) -> str:
        return type_name(self.tensor(name).type_id)

    def raw(self, name: str, rows: Optional[range] = None) -> torch.Tensor:
        """A matrix's stored rows (HF order, `rows` of them or all): uint8 [rows, bytes per row] for a block type,
        the float values for a float type. A type this reader does not know is an UnsupportedModelError."""
        t = self.tensor(name)
        if t.type_id not in BLOCK_TYPES and t.type_id not in FLOAT_TYPES:
            raise UnsupportedModelError(f"GGUF tensor {t.name} ({name}) has type {_ggml_type_name(t.type_id)}, "
                                        f"which Tandem cannot read; supported: "
                                        f"{', '.join(sorted([*FLOAT_TYPES.values(), *(b[0] for b in BLOCK_TYPES.values())]))}")
        self.used.add(name)
        order = t.row_order()
        if order is None:
            picked = t.data if rows is None else t.data[rows.start:rows.stop]
        else:
            picked = t.data[(order if rows is None else order[rows.start:rows.stop]).numpy()]
        values = torch.from_numpy(np.array(picked))  # a copy: the map stays read-only and can close
        return values.view(torch.bfloat16) if FLOAT_TYPES.get(t.type_id) == "BF16" else values

    def codes(self, name: str, rows: Optional[range] = None) -> Codes:
        """A block-quantized matrix's codes and group scales (rows in HF order)."""
        t = self.tensor(name)
        return unpack(t.type_id, self.raw(name, rows), t.shape[1])

    def get(self, name: str, dim: int = 0, part: Optional[range] = None) -> torch.Tensor:
        """The tensor as float32 values (dequantized for a block type), or rows (dim 0) / columns (dim 1) `part`."""
        t = self.tensor(name)
        rows = part if dim == 0 else None
        values = self.codes(name, rows).dequantize() if t.type_id in BLOCK_TYPES else self.raw(name, rows).float()
        if len(t.shape) == 1:
            values = values.reshape(-1)
        return values[:, part.start:part.stop] if dim == 1 and part is not None else values


def _ggml_type_name(type_id: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"{type_id} (unknown)"
