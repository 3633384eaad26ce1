"""LoRA adapters in PEFT format served side by side: requests with different adapters (and none) share one forward
pass, each token's LoRA delta computed by segmented matmuls over the tokens of each adapter in the batch.

The model's linear layers are untouched: forward hooks on qkv_proj, o_proj, gate_up_proj and down_proj add
x @ A.T @ B.T * scaling to the rows of the tokens that use an adapter. q/k/v and gate/up are fused here, so an adapter's A and B for them are stacked
into one block matrix per fused layer."""

from __future__ import annotations

import json
import os
import itertools
import re
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch
from safetensors.torch import load_file

from tandem.common.errors import InvalidRequestError
from tandem.common.memory.radix_cache import CacheNamespace
from tandem.common.model.config import ModelConfig

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
# Fused layer -> the checkpoint modules its output rows hold, in order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_GENERATIONS = itertools.count(1)  # one per adapter loaded, so a reload never shares the old load's cached KV
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")


class LoRAError(InvalidRequestError):
    """An adapter that cannot be loaded or used; names the field at fault."""


@dataclass
class LoRAAdapter:
    """One adapter: per (layer, fused layer) the stacked A [sum r, in] and block B [out, sum r], scaling folded in."""

    name: str  # the id requests select it by (GenerateRequest.lora_id)
    path: str
    rank: int
    lora_name: str = ""  # the human-readable name it was loaded under (the id unless the caller minted one)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    generation: int = field(default_factory=lambda: next(_GENERATIONS))
    unloaded: bool = False  # set by unload: its requests still running neither reuse nor publish cached prefixes

    @property
    def cache_namespace(self) -> CacheNamespace:
        """Where the RadixCache keeps the prefixes computed under this adapter (this load of it)."""
        return CacheNamespace(self.name, self.generation)


def _out_sizes(config: ModelConfig) -> dict[str, int]:
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": config.hidden_size,
            "gate_proj": config.intermediate_size, "up_proj": config.intermediate_size,
            "down_proj": config.hidden_size}


def _in_sizes(config: ModelConfig) -> dict[str, int]:
    q = config.num_heads * config.head_dim
    return {**{t: config.hidden_size for t in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")},
            "o_proj": q, "down_proj": config.intermediate_size}


def read_peft_config(path: str, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) from adapter_config.json; refuses what this implementation does not apply."""
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise LoRAError(f"lora_path {path!r} has no adapter_config.json (PEFT format expected)", "lora_path")
    with open(config_path, encoding="utf-8") as f:
        cfg = json.load(f)
    rank = int(cfg.get("r", 0))
    if not 1 <= rank <= max_rank:
        raise LoRAError(f"lora_path {path!r}: rank {rank} is outside 1..--max-lora-rank ({max_rank})", "lora_path")
    unsupported = {"use_dora": True, "fan_in_fan_out": True}
    for key, bad in unsupported.items():
        if cfg.get(key) == bad:
            raise LoRAError(f"lora_path {path!r}: {key}={bad} is not supported", "lora_path")
    if cfg.get("bias", "none") != "none" or cfg.get("modules_to_save"):
        raise LoRAError(f"lora_path {path!r}: bias and modules_to_save are not supported", "lora_path")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise LoRAError(f"lora_path {path!r}: rank_pattern/alpha_pattern are not supported", "lora_path")
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / rank ** 0.5 if cfg.get("use_rslora") else alpha / rank
    return rank, scaling


def load_adapter(name: str, path: str, config: ModelConfig, max_rank: int, device, dtype) -> LoRAAdapter:
    rank, scaling = read_peft_config(path, max_rank)
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_path):
        raise LoRAError(f"lora_path {path!r} has no adapter_model.safetensors", "lora_path")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(weights_path).items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in TARGETS or int(match.group(1)) >= config.num_layers:
            raise LoRAError(f"lora_path {path!r}: tensor {key!r} is not a LoRA weight of q/k/v/o/gate/up/down of "
                            f"this model", "lora_path")
        layer, target = int(match.group(1)), match.group(2)
        if target in MLP_TARGETS and config.is_moe_layer(layer):
            raise LoRAError(f"lora_path {path!r}: tensor {key!r} adapts the MLP of MoE layer {layer}; LoRA on "
                            "experts is not supported (adapters on the attention projections are)", "lora_path")
        pairs.setdefault((layer, target), {})[match.group(3)] = tensor
    outs, ins = _out_sizes(config), _in_sizes(config)
    adapter = LoRAAdapter(name, path, rank)
    for layer in range(config.num_layers):
        for fused, parts in FUSED.items():
            if not any((layer, p) in pairs for p in parts):
                continue
            a_rows, b_blocks = [], []
            for part in parts:
                a = pairs.get((layer, part), {}).get("A", torch.zeros(rank, ins[part]))
                b = pairs.get((layer, part), {}).get("B", torch.zeros(outs[part], rank))
                if tuple(a.shape) != (rank, ins[part]) or tuple(b.shape) != (outs[part], rank):
                    raise LoRAError(f"lora_path {path!r}: layer {layer} {part} has A {tuple(a.shape)} and B "
                                    f"{tuple(b.shape)}, expected ({rank}, {ins[part]}) and ({outs[part]}, {rank})",
                                    "lora_path")
                a_rows.append(a)
                b_blocks.append(b * scaling)
            adapter.weights[(layer, fused)] = (torch.cat(a_rows).to(device, dtype).contiguous(),
                                               torch.block_diag(*b_blocks).to(device, dtype).contiguous())
    if not adapter.weights:
        raise LoRAError(f"lora_path {path!r} holds no LoRA weights", "lora_path")
    return adapter


class LoRABatch:
    """The adapters of one forward pass: for each, the rows (token positions) that use it."""

    def __init__(self, segments: list[tuple[LoRAAdapter, Optional[torch.Tensor]]]):
        """rows None: the adapter covers every token of the batch."""
        self.segments = segments

    @classmethod
    def build(cls, adapters: list[Optional[LoRAAdapter]], tokens_per_req: list[int], device) -> Optional["LoRABatch"]:
        if not any(adapters):
            return None
        rows: dict[str, list[int]] = {}
        by_name: dict[str, LoRAAdapter] = {}
        start = 0
        for adapter, count in zip(adapters, tokens_per_req):
            if adapter is not None:
                rows.setdefault(adapter.name, []).extend(range(start, start + count))
                by_name[adapter.name] = adapter
            start += count
        if len(rows) == 1 and len(next(iter(rows.values()))) == start:  # one adapter for every token: no gather
            return cls([(next(iter(by_name.values())), None)])
        return cls([(by_name[n], torch.tensor(r, dtype=torch.int64, device=device)) for n, r in rows.items()])

    def delta(self, x: torch.Tensor, layer: int, fused: str, out_features: int) -> Optional[torch.Tensor]:
        """The LoRA contribution to a fused layer's output [T, out] (None when no adapter touches it)."""
        out = None
        for adapter, rows in self.segments:
            weights = adapter.weights.get((layer, fused))
            if weights is None:
                continue
            a, b = weights
            if rows is None:
                return (x @ a.t()) @ b.t()
            if out is None:
                out = x.new_zeros(x.shape[0], out_features)
            xs = x.index_select(0, rows)
            out.index_add_(0, rows, (xs @ a.t()) @ b.t())
        return out


class LoRAHooks:
    """Holds the current forward's LoRABatch (set by the model worker on the thread that runs the forward) and
    adds its deltas through forward hooks."""

    def __init__(self, model: torch.nn.Module):
        self.active: Optional[LoRABatch] = None
        for layer_id, layer in enumerate(model.model.layers):
            targets = [("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj)]
            if hasattr(layer.mlp, "gate_up_proj"):  # a dense MLP (an MoE layer's experts take no adapter)
                targets += [("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)]
            for fused, module in targets:
                module.register_forward_hook(self._hook(layer_id, fused))

    def _hook(self, layer_id: int, fused: str):
        def hook(module, inputs, output):
            if self.active is None:
                return None
            delta = self.active.delta(inputs[0], layer_id, fused, module.out_features)
            return None if delta is None else output + delta
        hook.lora_hooks = self  # cpu_layers runs a layer without its hooks only while no adapter batch is active
        return hook


class LoRARegistry:
    """The adapters loaded in one engine, by name; at most `max_loaded` at once (--max-loras-per-batch)."""

    def __init__(self, config: ModelConfig, max_rank: int, max_loaded: int, device, dtype, enabled: bool = True):
        """`enabled`: False with tensor parallelism, whose shards these hooks do not reach."""
        self.config, self.max_rank, self.max_loaded, self.enabled = config, max_rank, max_loaded, enabled
        self.device, self.dtype = device, dtype
        self.adapters: dict[str, LoRAAdapter] = {}
        self._lock = threading.Lock()

    def load(self, name: str, path: str, lora_id: str = "") -> LoRAAdapter:
        """Load under `lora_id` (default: the name), the id requests use."""
        if not name:
            raise LoRAError("lora_name must not be empty", "lora_name")
        if not self.enabled:
            raise LoRAError("LoRA adapters with --tp-size > 1 are not implemented yet", "lora_path")
        key = lora_id or name
        with self._lock:
            if key in self.adapters or any(a.lora_name == name for a in self.adapters.values()):
                raise LoRAError(f"lora adapter {name!r} (id {key!r}) is already loaded; unload it first",
                                "lora_name")
            if len(self.adapters) >= self.max_loaded:
                raise LoRAError(f"{self.max_loaded} adapters are loaded (--max-loras-per-batch); unload one first",
                                "lora_name")
        adapter = load_adapter(key, path, self.config, self.max_rank, self.device, self.dtype)
        adapter.lora_name = name
        with self._lock:
            self.adapters[key] = adapter
        return adapter

    def unload(self, name: str, lora_id: str = "") -> LoRAAdapter:
        """Requests already running keep the adapter until they end; new ones can no longer select it. The caller
        drops the adapter's cached prefixes (Engine.unload_lora)."""
        with self._lock:
            key = lora_id or next((k for k, a in self.adapters.items() if a.lora_name == name), name)
            adapter = self.adapters.get(key)
            if adapter is None or (name and adapter.lora_name != name):
                raise LoRAError(f"lora adapter {name or lora_id!r} is not loaded", "lora_name")
            del self.adapters[key]
            adapter.unloaded = True
            return adapter

    def loaded(self) -> list[LoRAAdapter]:
        with self._lock:
            return list(self.adapters.values())

    def get(self, name: Optional[str]) -> Optional[LoRAAdapter]:
        if not name:
            return None
        adapter = self.adapters.get(name)
        if adapter is None:
            raise LoRAError(f"lora_id {name!r} is not a loaded adapter (loaded: {sorted(self.adapters)})", "lora_id")
        return adapter
