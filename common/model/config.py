"""ModelConfig: the Llama-family hyper-parameters Tandem needs, read from a HF config.json."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from tandem.common.errors import UnsupportedModelError

logger = logging.getLogger(__name__)

DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
_QWEN_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts part of a config: which layers route, to how many experts, and how (HF's semantics)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's (HF: moe_intermediate_size; Mixtral: intermediate_size)
    norm_topk_prob: bool
    layers: tuple[int, ...]  # the layers whose MLP is sparse (mlp_only_layers, decoder_sparse_step)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert (0: none)
    # Mixtral keeps the routing weights in float32 up to the product with the expert output; Qwen casts them to
    # the activations' dtype first. Matters for bf16 parity.
    routing_in_fp32: bool = False
    # The checkpoint's names: "qwen" (mlp.experts.E.gate_proj/up_proj/down_proj, mlp.gate) or "mixtral"
    # (block_sparse_moe.experts.E.w1/w3/w2, block_sparse_moe.gate).
    naming: str = "qwen"
    # Physical expert slots (num_experts + EPLB's redundant copies) and how many of them one rank holds; set for
    # one rank's modules by parallel.layers.local_config / the loader (0: every slot, num_experts of them).
    num_physical_experts: int = 0
    num_local_experts: int = 0

    @property
    def physical_experts(self) -> int:
        return self.num_physical_experts or self.num_experts

    @property
    def local_experts(self) -> int:
        return self.num_local_experts or self.physical_experts


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None, or HF's dict: {"rope_type": "linear"|"dynamic"|"llama3", "factor": ..., ...}
    rope_scaling: Optional[dict[str, Any]] = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rope (Qwen3)
    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"
    sliding_window: Optional[int] = None
    # Longest sequence we serve correctly: max_position_embeddings, capped by a sliding window.
    context_len: int = 0
    moe: Optional[MoEConfig] = None  # None: a dense model
    # config.json's quantization_config (a pre-quantized checkpoint; model/quant/base.py), or None
    quantization: Optional[dict[str, Any]] = None

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.moe is not None and layer_id in self.moe.layers

    def __post_init__(self) -> None:
        if not self.context_len:
            self.context_len = self.max_position_embeddings

    @property
    def rope_type(self) -> str:
        return (self.rope_scaling or {}).get("rope_type", "default")

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "ModelConfig":
        gguf = gguf_file(model_dir)
        if gguf is not None:
            from tandem.common.model.quant.gguf_file import config_from_gguf  # gguf + torch: only for a .gguf

            return config_from_gguf(gguf)
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{model_dir!r} has no config.json; is it a HuggingFace model directory?")
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
        config = cls.from_hf_dict(hf)
        gen_path = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path, encoding="utf-8") as f:
                gen = json.load(f)
            for eos in _as_list(gen.get("eos_token_id")):
                if eos not in config.eos_token_ids:
                    config.eos_token_ids.append(eos)
            if config.bos_token_id is None:
                config.bos_token_id = gen.get("bos_token_id")
        return config

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"config.json architectures {archs or hf.get('model_type')!r} is not supported; "
                f"Tandem supports {', '.join(SUPPORTED_ARCHITECTURES)}")
        if hf.get("mlp_bias"):
            raise UnsupportedModelError(f"{arch} with mlp_bias=true is not supported")
        if hf.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModelError(f"{arch} with partial_rotary_factor != 1 is not supported")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope_theta, rope_scaling = _read_rope(hf, arch)
        max_pos = int(hf.get("max_position_embeddings", 2048))
        sliding_window = _effective_sliding_window(hf, arch)
        context_len = max_pos
        if sliding_window is not None and sliding_window < max_pos:
            # We only implement full attention, which matches sliding-window attention exactly while
            # every sequence fits in the window.
            logger.warning("%s uses sliding-window attention (window %d < max_position_embeddings %d); "
                           "capping the context length at %d tokens", arch, sliding_window, max_pos,
                           sliding_window)
            context_len = sliding_window
        return cls(
            architecture=arch,
            model_type=hf.get("model_type", ""),
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(hf, arch),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_as_list(hf.get("eos_token_id")),
            torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
            sliding_window=sliding_window,
            context_len=context_len,
            moe=_read_moe(hf, arch),
            quantization=dict(hf["quantization_config"]) if hf.get("quantization_config") else None,
        )


def gguf_file(model_path: str) -> Optional[str]:
    """The GGUF file a --model names: the path itself, or the one .gguf in a directory without safetensors
    weights; None for a HF checkpoint. A directory with several .gguf files is an UnsupportedModelError."""
    if os.path.isfile(model_path):
        return model_path if model_path.endswith(".gguf") else None
    if not os.path.isdir(model_path) or any(os.path.isfile(os.path.join(model_path, name)) for name in
                                            ("model.safetensors", "model.safetensors.index.json")):
        return None
    files = sorted(name for name in os.listdir(model_path) if name.endswith(".gguf"))
    if len(files) > 1:
        raise UnsupportedModelError(f"{model_path!r} holds {len(files)} GGUF files ({', '.join(files)}); pass "
                                    "the one to serve as --model")
    return os.path.join(model_path, files[0]) if files else None


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _read_rope(hf: dict[str, Any], arch: str) -> tuple[float, Optional[dict[str, Any]]]:
    """rope_theta and the scaling dict, from either the legacy keys (rope_theta, rope_scaling)
    or transformers v5's rope_parameters."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    merged = {**params, **scaling}
    rope_theta = float(hf.get("rope_theta") or merged.get("rope_theta") or 10000.0)
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{arch} with rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"{arch} with partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return rope_theta, None
    out: dict[str, Any] = {"rope_type": rope_type, "factor": float(merged["factor"])}
    if rope_type == "llama3":
        out["low_freq_factor"] = float(merged["low_freq_factor"])
        out["high_freq_factor"] = float(merged["high_freq_factor"])
        out["original_max_position_embeddings"] = int(
            merged.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
            or hf.get("max_position_embeddings", 2048))
    return rope_theta, out


def _effective_sliding_window(hf: dict[str, Any], arch: str) -> Optional[int]:
    window = hf.get("sliding_window")
    if not window:
        return None
    if arch in _QWEN_ARCHITECTURES and not hf.get("use_sliding_window", False):
        return None  # Qwen configs carry a window that is off unless use_sliding_window is set
    return int(window)


def _attention_bias(hf: dict[str, Any], arch: str) -> bool:
    if arch == "Qwen2ForCausalLM":
        return True
    if arch == "Qwen2MoeForCausalLM":
        return bool(hf.get("qkv_bias", True))
    return bool(hf.get("attention_bias", False))


def _read_moe(hf: dict[str, Any], arch: str) -> Optional[MoEConfig]:
    """The MoE part of an MoE architecture's config, with transformers' defaults; None for a dense one."""
    if arch not in MOE_ARCHITECTURES:
        return None
    num_layers = hf["num_hidden_layers"]
    num_experts = hf.get("num_experts") or hf.get("num_local_experts")
    if not num_experts or num_experts < 1:
        raise UnsupportedModelError(f"{arch}: config.json num_experts must be >= 1, got {num_experts!r}")
    top_k = int(hf.get("num_experts_per_tok") or 2)
    if not 1 <= top_k <= num_experts:
        raise UnsupportedModelError(f"{arch}: config.json num_experts_per_tok ({top_k}) must be between 1 and "
                                    f"num_experts ({num_experts})")
    if arch == "MixtralForCausalLM":
        return MoEConfig(num_experts, top_k, hf["intermediate_size"], norm_topk_prob=True,
                         layers=tuple(range(num_layers)), routing_in_fp32=True, naming="mixtral")
    step = int(hf.get("decoder_sparse_step") or 1)
    dense_only = set(hf.get("mlp_only_layers") or [])
    layers = tuple(i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0)
    shared = int(hf.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return MoEConfig(num_experts, top_k, hf["moe_intermediate_size"],
                     norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                     layers=layers, shared_expert_intermediate_size=shared)
