"""Where each expert lives under expert parallelism, and EPLB's placement of hot experts.

A model's experts are *logical* (the router's ids). A layer has num_experts + redundant *physical* slots, split
into equal contiguous runs over the --ep-size expert-parallel ranks: rank r holds slots [r * per, (r + 1) * per).
`physical_to_logical[layer][slot]` says which logical expert a slot holds; with redundant slots a hot expert is
held more than once, and its tokens are spread over its copies (moe.SparseMoeBlock.local_ids).

The default places logical expert i in slot i (slots past num_experts repeat 0, 1, ...). EPLB (`balanced`) follows
DeepSeek's load balancer, without node groups: give each redundant slot to the expert with the highest load per
copy (at most one copy per rank while another expert can take it), then pack the copies heaviest first onto the rank with the least load that still has a free slot.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from tandem.common.flags import ConfigError
from tandem.common.model.config import ModelConfig


@dataclass
class ExpertLocation:
    """physical_to_logical: int64 [MoE layers, physical slots]; ep_size: the ranks the slots split over."""

    physical_to_logical: torch.Tensor
    ep_size: int

    @property
    def num_physical(self) -> int:
        return self.physical_to_logical.shape[1]

    @property
    def per_rank(self) -> int:
        return self.num_physical // self.ep_size

    def slots(self, ep_rank: int) -> range:
        return range(ep_rank * self.per_rank, (ep_rank + 1) * self.per_rank)

    def block_maps(self, moe_index: int, num_logical: int,
                   ep_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For one MoE layer on one rank: physical_of [logical, max copies] (padded by repeating the first copy),
        replicas [logical], local_of_physical [physical] (-1: another rank's slot)."""
        p2l = self.physical_to_logical[moe_index]
        copies = [[slot for slot, e in enumerate(p2l.tolist()) if e == logical] for logical in range(num_logical)]
        width = max(len(c) for c in copies)
        physical_of = torch.tensor([c + [c[0]] * (width - len(c)) for c in copies], dtype=torch.int64)
        replicas = torch.tensor([len(c) for c in copies], dtype=torch.int64)
        local = torch.full((self.num_physical,), -1, dtype=torch.int64)
        mine = self.slots(ep_rank)
        local[mine.start: mine.stop] = torch.arange(len(mine))
        return physical_of, replicas, local

    def rank_loads(self, logical_counts: torch.Tensor) -> torch.Tensor:
        """Tokens each EP rank computes per layer [layers, ep_size], from per-logical-expert counts [layers,
        experts], a hot expert's tokens split evenly over its copies."""
        p2l = self.physical_to_logical
        copies = torch.zeros_like(logical_counts, dtype=torch.float64)
        copies.scatter_add_(1, p2l, torch.ones_like(p2l, dtype=torch.float64))
        per_slot = logical_counts.double().gather(1, p2l) / copies.gather(1, p2l)
        return per_slot.view(p2l.shape[0], self.ep_size, self.per_rank).sum(-1)

    def to_json(self) -> dict:
        return {"physical_to_logical_map": self.physical_to_logical.tolist(), "ep_size": self.ep_size}


def imbalance(rank_loads: torch.Tensor) -> torch.Tensor:
    """max / mean tokens per EP rank, per layer (1.0: perfectly balanced; a layer with no tokens counts as 1)."""
    mean = rank_loads.mean(-1)
    return torch.where(mean > 0, rank_loads.max(-1).values / mean.clamp_min(1e-12), torch.ones_like(mean))


def check_ep(config: ModelConfig, tp_size: int, ep_size: int, redundant: int) -> None:
    """Refuse at start-up an expert split that cannot work, naming the field."""
    if ep_size < 1 or tp_size % ep_size:
        raise ConfigError(f"--ep-size ({ep_size}) must be >= 1 and divide --tp-size ({tp_size}): expert-parallel "
                          "ranks are the tensor-parallel ranks (attention stays tensor-parallel over all of them)")
    moe = config.moe
    if moe is None:
        if ep_size > 1 or redundant:
            raise ConfigError(f"--ep-size {ep_size} / --ep-num-redundant-experts {redundant}: {config.architecture} "
                              "is a dense model (no experts to split)")
        return
    physical = moe.num_experts + redundant
    if physical % ep_size:
        raise ConfigError(f"config.json num_experts ({moe.num_experts}) + --ep-num-redundant-experts ({redundant}) "
                          f"= {physical} is not divisible by --ep-size ({ep_size})")
    moe_tp = tp_size // ep_size
    if moe.intermediate_size % moe_tp:
        raise ConfigError(f"config.json moe_intermediate_size ({moe.intermediate_size}) is not divisible by "
                          f"--tp-size / --ep-size ({moe_tp}), the ranks each expert's columns split over")
    if moe.shared_expert_intermediate_size % tp_size:
        raise ConfigError(f"config.json shared_expert_intermediate_size ({moe.shared_expert_intermediate_size}) is "
                          f"not divisible by --tp-size ({tp_size})")


def default_location(num_layers: int, num_logical: int, num_physical: int, ep_size: int) -> ExpertLocation:
    row = torch.arange(num_physical, dtype=torch.int64) % num_logical
    return ExpertLocation(row.repeat(num_layers, 1), ep_size)


def balanced(loads: torch.Tensor, num_physical: int, ep_size: int) -> ExpertLocation:
    """EPLB's placement for per-layer logical loads [layers, experts] (token counts)."""
    rows = [_balance_layer([float(v) for v in layer], num_physical, ep_size) for layer in loads.tolist()]
    return ExpertLocation(torch.tensor(rows, dtype=torch.int64), ep_size)


def _balance_layer(load: list[float], num_physical: int, ep_size: int) -> list[int]:
    num_logical = len(load)
    copies = [1] * num_logical
    for _ in range(num_physical - num_logical):  # each redundant slot to the heaviest load per copy
        # More copies than ranks would put two on one rank, where they share its load: no gain.
        room = [e for e in range(num_logical) if copies[e] < ep_size] or list(range(num_logical))
        hottest = max(room, key=lambda e: (load[e] / copies[e], -e))
        copies[hottest] += 1
    items = sorted(((load[e] / copies[e], e) for e in range(num_logical) for _ in range(copies[e])),
                   key=lambda item: (-item[0], item[1]))
    per_rank = num_physical // ep_size
    rank_load, rank_items = [0.0] * ep_size, [[] for _ in range(ep_size)]
    for weight, expert in items:
        # The lightest rank with a free slot; a second copy of an expert goes to another rank where one is free.
        free = [r for r in range(ep_size) if len(rank_items[r]) < per_rank]
        apart = [r for r in free if expert not in rank_items[r]] or free
        rank = min(apart, key=lambda r: (rank_load[r], r))
        rank_items[rank].append(expert)
        rank_load[rank] += weight
    return [expert for items_of_rank in rank_items for expert in sorted(items_of_rank)]


def load_location(path: str, num_layers: int, num_logical: int, num_physical: int, ep_size: int) -> ExpertLocation:
    """--init-expert-location: a JSON map {"physical_to_logical_map": [[...] per MoE layer]}, or a recorder dump
    ({"logical_count": [[...] per MoE layer], ...}) that EPLB places from."""
    if not os.path.isfile(path):
        raise ConfigError(f"--init-expert-location {path!r}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--init-expert-location {path!r}: not a JSON file ({e})") from e
    if "physical_to_logical_map" in data:
        table = _int_table(data["physical_to_logical_map"], path, "physical_to_logical_map", (num_layers, num_physical))
        if table.numel() and (table.min() < 0 or table.max() >= num_logical):
            raise ConfigError(f"--init-expert-location {path!r}: physical_to_logical_map holds an expert id outside "
                              f"0..{num_logical - 1}")
        for layer, row in enumerate(table.tolist()):
            missing = sorted(set(range(num_logical)) - set(row))
            if missing:
                raise ConfigError(f"--init-expert-location {path!r}: physical_to_logical_map[{layer}] places no "
                                  f"copy of expert {missing[0]}")
        return ExpertLocation(table, ep_size)
    if "logical_count" in data:
        counts = _int_table(data["logical_count"], path, "logical_count", (num_layers, num_logical))
        return balanced(counts, num_physical, ep_size)
    raise ConfigError(f"--init-expert-location {path!r}: expected physical_to_logical_map or logical_count (a "
                      "/dump_expert_distribution_record result)")


def _int_table(value, path: str, key: str, shape: Sequence[int]) -> torch.Tensor:
    try:
        table = torch.tensor(value, dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ConfigError(f"--init-expert-location {path!r}: {key} must be a list of integer lists ({e})") from e
    if tuple(table.shape) != tuple(shape):
        raise ConfigError(f"--init-expert-location {path!r}: {key} has shape {list(table.shape)}, this model and "
                          f"--ep-num-redundant-experts need {list(shape)} (MoE layers x experts)")
    return table


def initial_location(config: ModelConfig, ep_size: int, redundant: int,
                     init_file: Optional[str]) -> Optional[ExpertLocation]:
    """The placement a rank loads its experts by (the same on every rank); None for a dense model."""
    moe = config.moe
    if moe is None:
        return None
    physical = moe.num_experts + redundant
    if init_file:
        return load_location(init_file, len(moe.layers), moe.num_experts, physical, ep_size)
    return default_location(len(moe.layers), moe.num_experts, physical, ep_size)
