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


@dataclass
class BlockRemoved:
    block_hashes: list[int]


@dataclass
class AllCleared:
    pass


KVCacheEvent = Union[BlockStored, BlockRemoved, AllCleared]
