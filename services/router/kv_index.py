"""What each worker holds in its prefix cache (and in which tier), known from its KV events, and how much of a
prompt that covers."""

from __future__ import annotations

from typing import Optional

from smg_grpc_proto.generated import common_pb2

DEVICE, HOST, DISK = common_pb2.KV_CACHE_TIER_DEVICE, common_pb2.KV_CACHE_TIER_HOST, common_pb2.KV_CACHE_TIER_DISK

# What one matched token is worth to the router, by the fastest tier holding it. A device hit costs nothing; a host
# hit costs a host-to-device copy (~a tenth of recomputing it); a disk hit a storage read that may queue behind
# other workers' reads: still cheaper than recompute, but a worker holding the prefix higher up should win.
TIER_WEIGHTS = {DEVICE: 1.0, HOST: 0.8, DISK: 0.3}
# A worker that leaves the tier unset predates tiers: its events are about its device pool. EXTERNAL storage is
# read like a disk.
_TIER_OF = {common_pb2.KV_CACHE_TIER_UNSPECIFIED: DEVICE, common_pb2.KV_CACHE_TIER_EXTERNAL: DISK}


def _tier(value: int) -> int:
    return _TIER_OF.get(value, value)


class KvBlockIndex:
    """The block hashes one worker's HiRadixCache holds, each with the tiers holding a copy (a page may be on the
    device and on disk at once), maintained from SubscribeKvEvents."""

    def __init__(self, page_size: Optional[int] = None):
        self.page_size = page_size
        self.blocks: dict[int, set[int]] = {}  # block hash -> tiers (common_pb2.KV_CACHE_TIER_*)
        self.last_sequence = 0

    def apply(self, batch: common_pb2.KvEventBatch) -> None:
        if batch.sequence_number and batch.sequence_number <= self.last_sequence and batch.events:
            return  # a replayed batch we already applied
        for event in batch.events:
            kind = event.WhichOneof("data")
            if kind == "stored":
                self.add([block.block_hash for block in event.stored.blocks], _tier(event.stored.tier))
                for block in event.stored.blocks:
                    if block.block_size:
                        self.page_size = block.block_size
            elif kind == "removed":
                self._remove(event.removed.block_hashes, _tier(event.removed.tier))
            elif kind == "cleared":
                self.blocks.clear()
        if batch.events:
            self.last_sequence = max(self.last_sequence, batch.sequence_number)

    def add(self, hashes, tier: int = DEVICE) -> None:
        """Note a copy of each block in `tier`."""
        for h in hashes:
            self.blocks.setdefault(h, set()).add(tier)

    def _remove(self, hashes, tier: int) -> None:
        for h in hashes:
            tiers = self.blocks.get(h)
            if tiers is not None:
                tiers.discard(tier)
                if not tiers:
                    del self.blocks[h]

    def reset(self) -> None:
        self.blocks.clear()
        self.last_sequence = 0

    def cached_pages(self, hashes: list[int]) -> int:
        """How many leading pages of the chain this worker holds in any tier (a chain breaks at its first miss)."""
        count = 0
        for h in hashes:
            if h not in self.blocks:
                break
            count += 1
        return count

    def weighted_pages(self, hashes: list[int]) -> float:
        """The leading chain's pages, each weighted by the fastest tier holding it (TIER_WEIGHTS)."""
        score = 0.0
        for h in hashes:
            tiers = self.blocks.get(h)
            if not tiers:
                break
            score += max(TIER_WEIGHTS.get(t, 0.0) for t in tiers)
        return score
