"""Weights of a running model by checkpoint (HuggingFace) name: where each lives in our fused parameters, reading
a new set from disk or safetensors bytes, checking it whole, then copying it in."""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from common.model.config import ModelConfig
from common.model.loader import _open_checkpoint


class WeightUpdateError(ValueError):
    """A weight update that cannot be applied (bad path, unknown name, wrong shape); nothing was changed."""


@dataclass(frozen=True)
class WeightSlot:
    """Rows [start, start + rows) along dim 0 of our parameter `param` hold the checkpoint tensor."""

    param: str
    start: int
    rows: int


def weight_slots(config: ModelConfig) -> dict[str, WeightSlot]:
    """Checkpoint name -> where it lives: q/k/v are row blocks of qkv_proj, gate/up of gate_up_proj."""
    slots: dict[str, WeightSlot] = {}
    embed = "model.embed_tokens.weight"
    slots[embed] = WeightSlot(embed, 0, config.vocab_size)
    slots["model.norm.weight"] = WeightSlot("model.norm.weight", 0, config.hidden_size)
    # Tied: lm_head is the embedding (named_parameters lists it once), so its name updates the embedding.
    slots["lm_head.weight"] = WeightSlot(embed if config.tie_word_embeddings else "lm_head.weight", 0,
                                         config.vocab_size)
    q, kv, inter = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size
    for i in range(config.num_layers):
        layer = f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            slots[f"{layer}.{norm}.weight"] = WeightSlot(f"{layer}.{norm}.weight", 0, config.hidden_size)
        suffixes = ("weight", "bias") if config.attention_bias else ("weight",)
        for suffix in suffixes:
            qkv = f"{layer}.self_attn.qkv_proj.{suffix}"
            for name, start, rows in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
                slots[f"{layer}.self_attn.{name}_proj.{suffix}"] = WeightSlot(qkv, start, rows)
        slots[f"{layer}.self_attn.o_proj.weight"] = WeightSlot(f"{layer}.self_attn.o_proj.weight", 0,
                                                               config.hidden_size)
        if config.qk_norm:
            for norm in ("q_norm", "k_norm"):
                slots[f"{layer}.self_attn.{norm}.weight"] = WeightSlot(f"{layer}.self_attn.{norm}.weight", 0,
                                                                       config.head_dim)
        gate_up = f"{layer}.mlp.gate_up_proj.weight"
        slots[f"{layer}.mlp.gate_proj.weight"] = WeightSlot(gate_up, 0, inter)
        slots[f"{layer}.mlp.up_proj.weight"] = WeightSlot(gate_up, inter, inter)
        slots[f"{layer}.mlp.down_proj.weight"] = WeightSlot(f"{layer}.mlp.down_proj.weight", 0, config.hidden_size)
    return slots


class ModelWeights:
    """The model's parameters addressed by checkpoint name. `check` validates a whole update before `apply`
    touches anything, so a bad update leaves the old weights serving."""

    def __init__(self, model: torch.nn.Module, config: ModelConfig):
        self.model = model
        self.config = config
        self.slots = weight_slots(config)
        self.params = dict(model.named_parameters(remove_duplicate=True))

    def view(self, name: str) -> torch.Tensor:
        """The live tensor behind checkpoint name `name` (a view into a fused parameter)."""
        slot = self.slots.get(name)
        if slot is None:
            raise WeightUpdateError(f"unknown weight {name!r}; names are the checkpoint's, e.g. "
                                    "model.layers.0.self_attn.q_proj.weight")
        param = self.params[slot.param]
        return param.data.narrow(0, slot.start, slot.rows)

    def check(self, tensors: dict[str, torch.Tensor]) -> None:
        if not tensors:
            raise WeightUpdateError("the update holds no tensors")
        for name, tensor in tensors.items():
            target = self.view(name)
            if tuple(tensor.shape) != tuple(target.shape):
                raise WeightUpdateError(f"weight {name!r} has shape {tuple(tensor.shape)}, the model's is "
                                        f"{tuple(target.shape)} (a checkpoint of another architecture or size?)")
            if not tensor.is_floating_point():
                raise WeightUpdateError(f"weight {name!r} has dtype {tensor.dtype}; send a floating-point tensor")

    @torch.no_grad()
    def apply(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy every tensor in; call `check` first. Run only while no forward pass runs."""
        for name, tensor in tensors.items():
            target = self.view(name)
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))

    def complete(self, tensors: dict[str, torch.Tensor]) -> None:
        """A checkpoint must cover every parameter (lm_head aside when tied), or the model would mix two."""
        needed = {n for n, s in self.slots.items() if not (n == "lm_head.weight" and self.config.tie_word_embeddings)}
        missing = sorted(needed - set(tensors))
        if missing:
            raise WeightUpdateError(f"the checkpoint lacks {len(missing)} weight(s) the model needs, e.g. "
                                    f"{missing[:3]}")

    def get(self, name: str, truncate_size: int = 0) -> torch.Tensor:
        tensor = self.view(name)
        if truncate_size > 0:
            tensor = tensor[:truncate_size]
        return tensor.detach().to("cpu", torch.float32).clone()


def read_checkpoint(path: str, config: ModelConfig, weights: ModelWeights) -> dict[str, torch.Tensor]:
    """Every model weight from the safetensors checkpoint in `path`, checked against the running model."""
    if not os.path.isdir(path):
        raise WeightUpdateError(f"model_path {path!r} is not a directory the worker can read")
    try:
        other = ModelConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise WeightUpdateError(f"model_path {path!r}: cannot read config.json ({e})") from e
    if (other.architecture, other.num_layers, other.hidden_size) != (config.architecture, config.num_layers,
                                                                    config.hidden_size):
        raise WeightUpdateError(
            f"model_path {path!r} is a {other.architecture} with {other.num_layers} layers of {other.hidden_size}; "
            f"the running model is a {config.architecture} with {config.num_layers} layers of {config.hidden_size}")
    with ExitStack() as stack:
        try:
            reader = _open_checkpoint(path, stack)
        except FileNotFoundError as e:
            raise WeightUpdateError(str(e)) from e
        names = [n for n in reader.where if n in weights.slots]
        tensors = {n: reader.get(n) for n in names}
    weights.complete(tensors)
    weights.check(tensors)
    return tensors


def tensors_from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    """safetensors bytes -> named tensors (never pickle)."""
    try:
        return load_safetensors(data)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise WeightUpdateError(f"named_tensors is not a safetensors payload: {e}") from e


def tensors_to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    return save_safetensors({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()})
