"""Moving experts between expert-parallel ranks for a new placement (EPLB), between two forward passes.

Every rank runs the same plan from the old and the new ExpertLocation: for each slot whose expert changes, the
rank that will hold it copies it from one of its own slots when it already holds that expert, else receives it
from the lowest rank that holds it (point-to-point over the layers' process group; the sender sends from its old
slot). Ranks that split each expert's columns (--tp-size > --ep-size) exchange only with the rank that holds the
same columns. A layer's new stack is built beside the old one, then copied in place, one layer at a time, so the
extra memory is one layer's experts and the parameters keep their storage (weight views, packed copies).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from tandem.common.model.moe import moe_blocks
from tandem.common.model.parallel.dist import TPGroup
from tandem.common.model.parallel.experts import ExpertLocation
from tandem.common.model.parallel.layers import TPShard


def _source(row: list[int], expert: int, dest_ep: int, per_rank: int) -> tuple[int, int]:
    """(ep rank, local slot) to take `expert` from: the destination itself when it holds it, else the lowest rank."""
    own = [slot for slot in range(dest_ep * per_rank, (dest_ep + 1) * per_rank) if row[slot] == expert]
    slot = own[0] if own else row.index(expert)
    return slot // per_rank, slot % per_rank


@torch.no_grad()
def move_experts(model: torch.nn.Module, old: ExpertLocation, new: ExpertLocation, shard: TPShard,
                 group: Optional[TPGroup]) -> int:
    """Rearrange this rank's experts from `old` to `new` (every rank of the group calls it with the same
    arguments); returns how many slots of this rank received another expert."""
    if old.physical_to_logical.shape != new.physical_to_logical.shape or old.ep_size != new.ep_size:
        raise ValueError(f"a new expert placement must keep the shape {list(old.physical_to_logical.shape)} and "
                         f"--ep-size {old.ep_size}")
    per, moe_tp, my_ep = old.per_rank, shard.moe_tp_size, shard.ep_rank
    column = shard.rank % moe_tp
    changed = 0
    for block in moe_blocks(model):
        old_row = old.physical_to_logical[block.moe_index].tolist()
        new_row = new.physical_to_logical[block.moe_index].tolist()
        experts = block.experts
        if old_row != new_row:
            w13, w2 = experts.w13_weight, experts.w2_weight
            new13, new2 = torch.empty_like(w13), torch.empty_like(w2)
            pending = []
            for slot, expert in enumerate(new_row):
                dest_ep, dest_j = divmod(slot, per)
                src_ep, src_j = _source(old_row, expert, dest_ep, per)
                if dest_ep == my_ep and old_row[slot] != expert:
                    changed += 1
                if src_ep == dest_ep:
                    if dest_ep == my_ep:
                        new13[dest_j].copy_(w13[src_j])
                        new2[dest_j].copy_(w2[src_j])
                    continue
                tags = (2 * slot, 2 * slot + 1)
                if my_ep == src_ep:
                    peer = dest_ep * moe_tp + column
                    pending += [dist.isend(w13[src_j].contiguous(), group=group.math_group, group_dst=peer, tag=tags[0]),
                                dist.isend(w2[src_j].contiguous(), group=group.math_group, group_dst=peer, tag=tags[1])]
                elif my_ep == dest_ep:
                    peer = src_ep * moe_tp + column
                    pending += [dist.irecv(new13[dest_j], group=group.math_group, group_src=peer, tag=tags[0]),
                                dist.irecv(new2[dest_j], group=group.math_group, group_src=peer, tag=tags[1])]
            for work in pending:
                work.wait()
            w13.copy_(new13)
            w2.copy_(new2)
            experts.repack()
        block.set_placement(*new.block_maps(block.moe_index, block.physical_of.shape[0], my_ep))
    return changed


def location_bytes(location: ExpertLocation) -> bytes:
    """The placement on the wire to the other ranks: its int64 table's bytes (no pickle)."""
    return location.physical_to_logical.contiguous().numpy().tobytes()


def location_from_bytes(data: bytes, like: ExpertLocation) -> ExpertLocation:
    table = torch.frombuffer(bytearray(data), dtype=torch.int64)
    return ExpertLocation(table.view(like.physical_to_logical.shape).clone(), like.ep_size)
