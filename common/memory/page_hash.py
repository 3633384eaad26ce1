"""The page hash a worker's RadixCache keys its KV events by, and the router its prefix index (torch-free)."""

from __future__ import annotations

import hashlib
from array import array
from typing import Optional


def block_hash(parent_hash: Optional[int], page_token_ids: list[int]) -> int:
    """Stable signed 64-bit hash of a page given its parent block's hash (None for the first page)."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent_hash or 0).to_bytes(8, "little", signed=True))
    h.update(array("q", page_token_ids).tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


def namespace_seed(lora_id: str) -> Optional[int]:
    """What an adapter's first page chains from (None for the base model): KV computed under different adapters
    gets different hashes for the same tokens, so a prefix index keyed by hash keys on the adapter too."""
    if not lora_id:
        return None
    return int.from_bytes(hashlib.blake2b(b"lora:" + lora_id.encode(), digest_size=8).digest(), "little", signed=True)


def page_hashes(token_ids: list[int], page_size: int, lora_id: str = "") -> list[int]:
    """Hashes of the prompt's full pages, each chained from the one before, as the worker's cache keys them
    under adapter ``lora_id`` ("" for the base model)."""
    hashes, parent = [], namespace_seed(lora_id)
    for start in range(0, len(token_ids) - len(token_ids) % page_size, page_size):
        parent = block_hash(parent, token_ids[start:start + page_size])
        hashes.append(parent)
    return hashes
