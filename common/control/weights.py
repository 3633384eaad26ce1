"""Weights of a running model by checkpoint (HuggingFace) name: where each lives in our fused parameters (of this
tensor-parallel rank's shard), reading a new set from disk or safetensors bytes, checking it whole, then copying it
in."""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Optional

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from tandem.common.errors import WeightUpdateError
from tandem.common.model.config import ModelConfig
from tandem.common.model.cpu_linear import repack_weights
from tandem.common.model.loader import _open_checkpoint
from tandem.common.model.parallel.layers import TPShard, local_config


@dataclass(frozen=True)
class ShardRule:
    """A rank holds `part` of the checkpoint tensor along `dim`, whose full length is `full`; a vocabulary shard is
    zero-padded to `rows` (the loader's layout)."""

    dim: int
    part: range
    full: int
    rows: int = 0


def shard_rules(config: ModelConfig, shard: TPShard) -> dict[str, ShardRule]:
    """Checkpoint name -> the slice rank `shard` holds, as common.model.loader._shard_sources reads it; names not
    listed (the norms) are replicated."""
    hd = config.head_dim
    q, kv, mlp = shard.q_heads(config), shard.kv_heads(config), shard.intermediate(config)
    q_rows, kv_rows = range(q.start * hd, q.stop * hd), range(kv.start * hd, kv.stop * hd)
    q_full, kv_full = config.num_heads * hd, config.num_kv_heads * hd
    vocab = ShardRule(0, shard.vocab(config), config.vocab_size, shard.vocab_rows_per_rank(config))
    rules = {"model.embed_tokens.weight": vocab, "lm_head.weight": vocab}
    for i in range(config.num_layers):
        attn, mlp_name = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        for suffix in ("weight", "bias"):
            rules[f"{attn}.q_proj.{suffix}"] = ShardRule(0, q_rows, q_full)
            rules[f"{attn}.k_proj.{suffix}"] = ShardRule(0, kv_rows, kv_full)
            rules[f"{attn}.v_proj.{suffix}"] = ShardRule(0, kv_rows, kv_full)
        rules[f"{attn}.o_proj.weight"] = ShardRule(1, q_rows, q_full)
        rules[f"{mlp_name}.gate_proj.weight"] = ShardRule(0, mlp, config.intermediate_size)
        rules[f"{mlp_name}.up_proj.weight"] = ShardRule(0, mlp, config.intermediate_size)
        rules[f"{mlp_name}.down_proj.weight"] = ShardRule(1, mlp, config.intermediate_size)
    return rules


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if not rows or tensor.shape[0] >= rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])


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
    """The model's parameters addressed by checkpoint name. `check` validates a whole update (full checkpoint
    tensors) before `apply` touches anything, so a bad update leaves the old weights serving. With `shard` (a
    tensor-parallel rank) the parameters are that rank's: `localize` cuts a full tensor to its slice."""

    def __init__(self, model: torch.nn.Module, config: ModelConfig, shard: Optional[TPShard] = None):
        self.model = model
        self.config = config
        self.shard = shard
        self.slots = weight_slots(config if shard is None else local_config(config, shard))
        self.rules = shard_rules(config, shard) if shard is not None else {}
        self.params = dict(model.named_parameters(remove_duplicate=True))

    def view(self, name: str) -> torch.Tensor:
        """The live tensor behind checkpoint name `name` (a view into a fused parameter)."""
        slot = self.slots.get(name)
        if slot is None:
            raise WeightUpdateError(f"unknown weight {name!r}; names are the checkpoint's, e.g. "
                                    "model.layers.0.self_attn.q_proj.weight")
        param = self.params[slot.param]
        return param.data.narrow(0, slot.start, slot.rows)

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The checkpoint tensor's shape (the whole model's, whatever this rank holds of it)."""
        shape = list(self.view(name).shape)
        rule = self.rules.get(name)
        if rule is not None:
            shape[rule.dim] = rule.full
        return tuple(shape)

    def localize(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full checkpoint tensor (the tensor itself without tensor parallelism)."""
        rule = self.rules.get(name)
        if rule is None:
            return tensor
        return pad_rows(tensor.narrow(rule.dim, rule.part.start, len(rule.part)), rule.rows)

    def read_local(self, reader, name: str) -> torch.Tensor:
        """This rank's slice of checkpoint tensor `name`, reading only that slice from the safetensors file."""
        rule = self.rules.get(name)
        if rule is None:
            return reader.get(name)
        return pad_rows(reader.get(name, rule.dim, rule.part), rule.rows)

    def check(self, tensors: dict[str, torch.Tensor]) -> None:
        if not tensors:
            raise WeightUpdateError("the update holds no tensors")
        for name, tensor in tensors.items():
            self.check_shape(name, tuple(tensor.shape))
            if not tensor.is_floating_point():
                raise WeightUpdateError(f"weight {name!r} has dtype {tensor.dtype}; send a floating-point tensor")

    def check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        expected = self.full_shape(name)
        if tuple(shape) != expected:
            raise WeightUpdateError(f"weight {name!r} has shape {tuple(shape)}, the model's is {expected} "
                                    "(a checkpoint of another architecture or size?)")

    @torch.no_grad()
    def apply(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy every tensor in, each already this rank's slice (`localize`); call `check` on the full tensors
        first. Run only while no forward pass runs."""
        for name, tensor in tensors.items():
            target = self.view(name)
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        repack_weights(self.model)  # the writes above go through .data, which no version counter sees

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
    """Every model weight from the safetensors checkpoint in `path`, checked against the running model; each is
    this rank's slice (only that slice is read), ready for `apply`."""
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
        weights.complete(dict.fromkeys(names))
        for name in names:
            weights.check_shape(name, tuple(reader.shape(name)))
        tensors = {n: weights.read_local(reader, n) for n in names}
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise WeightUpdateError(f"weight {name!r} has dtype {tensor.dtype}; the checkpoint must hold floats")
    return tensors


def tensors_from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    """safetensors bytes -> named tensors (never pickle)."""
    try:
        return load_safetensors(data)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise WeightUpdateError(f"named_tensors is not a safetensors payload: {e}") from e


def tensors_to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    return save_safetensors({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()})
