"""Where an MoE layer's parameters come from in a HF checkpoint: the router, this rank's expert slots (each the
logical expert its placement names, maybe a slice of its columns) stacked, and Qwen2-MoE's shared expert."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from tandem.common.model.config import ModelConfig
from tandem.common.model.parallel.experts import ExpertLocation
from tandem.common.model.parallel.layers import TPShard

# naming -> (the MLP's module name, gate, up, down) in the checkpoint
CHECKPOINT_NAMES = {"qwen": ("mlp", "gate_proj", "up_proj", "down_proj"),
                    "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}


def hf_expert_names(config: ModelConfig, layer: int, expert: int) -> tuple[str, str, str]:
    """The checkpoint's gate, up and down weight names of one logical expert."""
    block, gate, up, down = CHECKPOINT_NAMES[config.moe.naming]
    prefix = f"model.layers.{layer}.{block}.experts.{expert}"
    return f"{prefix}.{gate}.weight", f"{prefix}.{up}.weight", f"{prefix}.{down}.weight"


def hf_router_name(config: ModelConfig, layer: int) -> str:
    return f"model.layers.{layer}.{CHECKPOINT_NAMES[config.moe.naming][0]}.gate.weight"


def read_w13(read, config: ModelConfig, layer: int, expert: int, columns: Optional[range]) -> torch.Tensor:
    """One logical expert's w13 [2 x cols, hidden] (gate rows, then up), `columns` of its intermediate size (None:
    all)."""
    gate, up, _ = hf_expert_names(config, layer, expert)
    return torch.cat([read.get(gate, 0, columns), read.get(up, 0, columns)])


def read_w2(read, config: ModelConfig, layer: int, expert: int, columns: Optional[range]) -> torch.Tensor:
    """One logical expert's w2 [hidden, cols]."""
    return read.get(hf_expert_names(config, layer, expert)[2], 1, columns)


def expert_sources(config: ModelConfig, shard: TPShard,
                   location: ExpertLocation) -> dict[str, Callable[..., torch.Tensor]]:
    """Our MoE parameter name -> how to read it, for one rank (`shard`) of a model placed by `location`."""
    moe = config.moe
    columns = shard.expert_intermediate(config) if shard.size > 1 else None
    slots = location.slots(shard.ep_rank)
    sources = {}
    for moe_index, layer in enumerate(moe.layers):
        ours = f"model.layers.{layer}.mlp"
        logical = location.physical_to_logical[moe_index, slots.start: slots.stop].tolist()

        sources[f"{ours}.gate.weight"] = lambda r, n=hf_router_name(config, layer): r.get(n)
        sources[f"{ours}.experts.w13_weight"] = lambda r, layer=layer, logical=logical: torch.stack(
            [read_w13(r, config, layer, e, columns) for e in logical])
        sources[f"{ours}.experts.w2_weight"] = lambda r, layer=layer, logical=logical: torch.stack(
            [read_w2(r, config, layer, e, columns) for e in logical])
        if moe.shared_expert_intermediate_size:
            shared = shard.shared_intermediate(config) if shard.size > 1 else None
            hf = f"model.layers.{layer}.mlp.shared_expert"
            sources[f"{ours}.shared_expert.gate_up_proj.weight"] = lambda r, hf=hf, c=shared: torch.cat(
                [r.get(f"{hf}.gate_proj.weight", 0, c), r.get(f"{hf}.up_proj.weight", 0, c)])
            sources[f"{ours}.shared_expert.down_proj.weight"] = lambda r, hf=hf, c=shared: r.get(
                f"{hf}.down_proj.weight", 1, c)
            sources[f"{ours}.shared_expert_gate.weight"] = lambda r, n=f"{hf}_gate.weight": r.get(n)
    return sources
