"""What each worker holds in its prefix cache, known from its KV events, and how much of a prompt that covers."""

from __future__ import annotations

from typing import Optional

from smg_grpc_proto.generated import common_pb2



class KvBlockIndex:
    """The set of block hashes one worker's RadixCache holds, maintained from SubscribeKvEvents."""

    def __init__(self, page_size: Optional[int] = None):
        self.page_size = page_size
        self.blocks: set[int] = set()
        self.last_sequence = 0

    def apply(self, batch: common_pb2.KvEventBatch) -> None:
        if batch.sequence_number and batch.sequence_number <= self.last_sequence and batch.events:
            return  # a replayed batch we already applied
        for event in batch.events:
            kind = event.WhichOneof("data")
            if kind == "stored":
                for block in event.stored.blocks:
                    self.blocks.add(block.block_hash)
                    if block.block_size:
                        self.page_size = block.block_size
            elif kind == "removed":
                self.blocks.difference_update(event.removed.block_hashes)
            elif kind == "cleared":
                self.blocks.clear()
        if batch.events:
            self.last_sequence = max(self.last_sequence, batch.sequence_number)

    def reset(self) -> None:
        self.blocks.clear()
        self.last_sequence = 0

    def cached_pages(self, hashes: list[int]) -> int:
        """How many leading pages of the chain this worker holds (a chain breaks at its first miss)."""
        count = 0
        for h in hashes:
            if h not in self.blocks:
                break
            count += 1
        return count
