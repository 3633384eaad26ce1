"""Weights of a running model by checkpoint (HuggingFace) name: where each lives in our fused parameters (of this
tensor-parallel rank's shard), reading a new set from disk or safetensors bytes, checking it whole, then copying it
in. An MoE expert's names map to every slot of this rank's expert stacks that holds a copy of it (none, one, or
several with redundant experts)."""

from __future__ import annotations

import os
import re
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
from tandem.common.model.moe_weights import hf_expert_names, hf_router_name
from tandem.common.model.parallel.experts import ExpertLocation
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
        if config.is_moe_layer(i):
            rules.update(moe_rules(config, shard, i))
            continue
        rules[f"{mlp_name}.gate_proj.weight"] = ShardRule(0, mlp, config.intermediate_size)
        rules[f"{mlp_name}.up_proj.weight"] = ShardRule(0, mlp, config.intermediate_size)
        rules[f"{mlp_name}.down_proj.weight"] = ShardRule(1, mlp, config.intermediate_size)
    return rules


def moe_rules(config: ModelConfig, shard: TPShard, layer: int) -> dict[str, ShardRule]:
    """An MoE layer's sliced names: each expert's columns split over the ranks that share an expert, the shared
    expert's over all ranks (as moe_weights.expert_sources reads them); the router is replicated."""
    moe, rules = config.moe, {}
    columns = shard.expert_intermediate(config)
    for expert in range(moe.num_experts):
        gate, up, down = hf_expert_names(config, layer, expert)
        rules[gate] = rules[up] = ShardRule(0, columns, moe.intermediate_size)
        rules[down] = ShardRule(1, columns, moe.intermediate_size)
    if moe.shared_expert_intermediate_size:
        shared, full = shard.shared_intermediate(config), moe.shared_expert_intermediate_size
        hf = f"model.layers.{layer}.mlp.shared_expert"
        rules[f"{hf}.gate_proj.weight"] = rules[f"{hf}.up_proj.weight"] = ShardRule(0, shared, full)
        rules[f"{hf}.down_proj.weight"] = ShardRule(1, shared, full)
    return rules


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if not rows or tensor.shape[0] >= rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])


@dataclass(frozen=True)
class WeightSlot:
    """Rows [start, start + rows) along dim 0 of our parameter `param` hold the checkpoint tensor. For a stacked
    expert parameter ([slots, rows, cols]), those rows of each of this rank's slots `experts` (none: another
    expert-parallel rank holds that expert; several: redundant copies)."""

    param: str
    start: int
    rows: int
    experts: Optional[tuple[int, ...]] = None


def weight_slots(config: ModelConfig, location: Optional[ExpertLocation] = None,
                 ep_rank: int = 0) -> dict[str, WeightSlot]:
    """Checkpoint name -> where it lives: q/k/v are row blocks of qkv_proj, gate/up of gate_up_proj; an MoE
    layer's experts are in the slots `location` gives expert-parallel rank `ep_rank`."""
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
        if config.is_moe_layer(i):
            slots.update(moe_slots(config, i, location, ep_rank))
            continue
        gate_up = f"{layer}.mlp.gate_up_proj.weight"
        slots[f"{layer}.mlp.gate_proj.weight"] = WeightSlot(gate_up, 0, inter)
        slots[f"{layer}.mlp.up_proj.weight"] = WeightSlot(gate_up, inter, inter)
        slots[f"{layer}.mlp.down_proj.weight"] = WeightSlot(f"{layer}.mlp.down_proj.weight", 0, config.hidden_size)
    return slots


def moe_slots(config: ModelConfig, layer: int, location: ExpertLocation, ep_rank: int) -> dict[str, WeightSlot]:
    """One MoE layer (`config` the rank's local one): the router, each logical expert's gate/up (row blocks of
    w13) and down (w2) in every slot of this rank that holds it, Qwen2-MoE's shared expert and its gate."""
    moe, hidden, ours = config.moe, config.hidden_size, f"model.layers.{layer}.mlp"
    inter = moe.intermediate_size
    mine = location.slots(ep_rank)
    logical = location.physical_to_logical[config.moe.layers.index(layer), mine.start: mine.stop].tolist()
    slots = {hf_router_name(config, layer): WeightSlot(f"{ours}.gate.weight", 0, moe.num_experts)}
    for expert in range(moe.num_experts):
        held = tuple(s for s, e in enumerate(logical) if e == expert)
        gate, up, down = hf_expert_names(config, layer, expert)
        slots[gate] = WeightSlot(f"{ours}.experts.w13_weight", 0, inter, held)
        slots[up] = WeightSlot(f"{ours}.experts.w13_weight", inter, inter, held)
        slots[down] = WeightSlot(f"{ours}.experts.w2_weight", 0, hidden, held)
    if moe.shared_expert_intermediate_size:
        shared, hf = moe.shared_expert_intermediate_size, f"{ours}.shared_expert"
        slots[f"{hf}.gate_proj.weight"] = WeightSlot(f"{hf}.gate_up_proj.weight", 0, shared)
        slots[f"{hf}.up_proj.weight"] = WeightSlot(f"{hf}.gate_up_proj.weight", shared, shared)
        slots[f"{hf}.down_proj.weight"] = WeightSlot(f"{hf}.down_proj.weight", 0, hidden)
        slots[f"{ours}.shared_expert_gate.weight"] = WeightSlot(f"{ours}.shared_expert_gate.weight", 0, 1)
    return slots


# A per-expert checkpoint name: model.layers.L.<mlp or block_sparse_moe>.experts.E.<proj>.weight
EXPERT_NAME = re.compile(r"^model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.")


class ModelWeights:
    """The model's parameters addressed by checkpoint name. `check` validates a whole update (full checkpoint
    tensors) before `apply` touches anything, so a bad update leaves the old weights serving. With `shard` (a
    tensor-parallel rank) the parameters are that rank's: `localize` cuts a full tensor to its slice. An MoE
    model's placement is `model.expert_location` (set by the loader): an expert's names write every slot of this
    rank that holds it; names of experts held by other ranks are accepted and skipped here."""

    def __init__(self, model: torch.nn.Module, config: ModelConfig, shard: Optional[TPShard] = None):
        self.model = model
        self.config = config
        self.shard = shard
        self.local = config if shard is None else local_config(config, shard)
        self.rules = shard_rules(config, shard) if shard is not None else {}
        self.params = dict(model.named_parameters(remove_duplicate=True))
        self._location: Optional[ExpertLocation] = None
        self._slots: Optional[dict[str, WeightSlot]] = None

    @property
    def ep_rank(self) -> int:
        return self.shard.ep_rank if self.shard is not None else 0

    @property
    def slots(self) -> dict[str, WeightSlot]:
        """Checkpoint name -> WeightSlot; rebuilt when the model's expert placement object is replaced."""
        location = getattr(self.model, "expert_location", None)
        if self._slots is None or location is not self._location:
            if self.config.moe is not None and location is None:
                raise RuntimeError("an MoE model without model.expert_location (load it with loader.load_model)")
            self._slots = weight_slots(self.local, location, self.ep_rank)
            self._location = location
        return self._slots

    def slot(self, name: str) -> WeightSlot:
        slot = self.slots.get(name)
        if slot is None:
            raise WeightUpdateError(self._unknown(name))
        if slot.param not in self.params:
            module = self.model.get_submodule(slot.param.rsplit(".", 1)[0])
            raise WeightUpdateError(f"weight {name!r} is held quantized ({type(module).__name__}): reading or "
                                    "updating quantized weights at runtime is not supported; restart the worker on "
                                    "the new checkpoint")
        return slot

    def _unknown(self, name: str) -> str:
        moe, match = self.config.moe, EXPERT_NAME.match(name)
        if moe is not None and match is not None and int(match[2]) >= moe.num_experts:
            return (f"unknown weight {name!r}: there is no expert {match[2]} (the model's MoE layers have experts "
                    f"0..{moe.num_experts - 1})")
        return f"unknown weight {name!r}; names are the checkpoint's, e.g. model.layers.0.self_attn.q_proj.weight"

    def targets(self, name: str) -> list[torch.Tensor]:
        """The live tensors checkpoint name `name` is written to (views into fused parameters): one, or for an
        expert one per slot of this rank holding it (none where another expert-parallel rank holds it)."""
        slot = self.slot(name)
        param = self.params[slot.param].data
        if slot.experts is None:
            return [param.narrow(0, slot.start, slot.rows)]
        return [param[s].narrow(0, slot.start, slot.rows) for s in slot.experts]

    def held(self, name: str) -> bool:
        """False for an expert only other expert-parallel ranks hold: this rank reads and writes nothing of it."""
        return self.slot(name).experts != ()

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The checkpoint tensor's shape (the whole model's, whatever this rank holds of it)."""
        slot = self.slot(name)
        shape = list(self.params[slot.param].shape[0 if slot.experts is None else 1:])
        shape[0] = slot.rows
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

    def localize_all(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's slices of checked full tensors, without the experts it does not hold."""
        return {n: self.localize(n, t) for n, t in tensors.items() if self.held(n)}

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
            for target in self.targets(name):
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
        """The weight as this rank holds it: an expert's is its first copy here, the whole logical tensor unless
        tensor parallelism splits its columns. Refused for an expert only other expert-parallel ranks hold."""
        targets = self.targets(name)
        if not targets:
            raise WeightUpdateError(self._held_elsewhere(name))
        tensor = targets[0]
        if truncate_size > 0:
            tensor = tensor[:truncate_size]
        return tensor.detach().to("cpu", torch.float32).clone()

    def _held_elsewhere(self, name: str) -> str:
        layer, expert = (int(g) for g in EXPERT_NAME.match(name).groups())
        location = self._location
        row = location.physical_to_logical[self.config.moe.layers.index(layer)].tolist()
        ranks = sorted({slot // location.per_rank for slot, e in enumerate(row) if e == expert})
        return (f"{name!r}: expert {expert} of layer {layer} is held by expert-parallel rank(s) {ranks}; this read "
                f"answers from rank {self.ep_rank}'s experts only")


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
        tensors = {n: weights.read_local(reader, n) for n in names if weights.held(n)}  # another rank's: skipped
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
