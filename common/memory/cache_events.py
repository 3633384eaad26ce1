"""The RadixCache's KV events (for gateways that route by cached prefix): plain data, torch-free, so the gRPC
layer that converts them (and a DP controller importing it) does not load torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass
class BlockStored:
    """Pages newly cached; one block per page, hashes chained from ``parent_block_hash``."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: str = ""  # the adapter the KV was computed under ("" for the base model); also folded into the hashes
    tier: str = "device"  # where the new copy is: device (L1), host (L2) or disk (L3); see docs/hicache.md


@dataclass
class BlockRemoved:
    block_hashes: list[int]
    tier: str = "device"  # the tier whose copy went; copies in other tiers may remain


@dataclass
class AllCleared:
    pass


KV_TIERS = ("device", "host", "disk")

KVCacheEvent = Union[BlockStored, BlockRemoved, AllCleared]
