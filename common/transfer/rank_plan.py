"""Prefill and decode at different tensor-parallel sizes: each side's per-rank pools, the registration check that
refuses pools which cannot exchange KV, and the write plan (which prefill rank WRITEs which heads into which decode
rank, at which head offsets)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from tandem.common.proto_gen.tandem import bootstrap_pb2 as pb
from tandem.common.transfer.messages import KVLayout
from tandem.common.transfer.nixl_backend import NixlBackend, RemotePool

KV_LAYOUT_FIELDS = ("num_layers", "page_size", "num_kv_heads", "head_dim", "dtype", "num_pages")
# Fields every rank's pool must share with every peer rank's (heads differ per rank; num_pages may differ). An FP8
# pool's bytes mean scale * float(byte): both sides must read them with the same scales.
RANK_MATCHED_FIELDS = ("num_layers", "page_size", "head_dim", "dtype", "k_scales", "v_scales")


@dataclass(frozen=True)
class RankPool:
    """One rank's pool shard as a peer sees it: its NIXL agent, its layout, and the model's KV heads it holds."""

    rank: int
    agent_name: str
    agent_metadata: bytes
    layout: pb.KVLayout
    heads: range  # global KV head indices, in pool order

    def to_proto(self) -> pb.RankPool:
        return pb.RankPool(rank=self.rank, agent_name=self.agent_name, agent_metadata=self.agent_metadata,
                           layout=self.layout, kv_head_start=self.heads.start)

    @classmethod
    def from_proto(cls, msg: pb.RankPool) -> RankPool:
        start = msg.kv_head_start
        return cls(msg.rank, msg.agent_name, msg.agent_metadata, msg.layout,
                   range(start, start + msg.layout.num_kv_heads))


@dataclass(frozen=True)
class Slice:
    """Local heads [src_head, src_head + count) of a prefill rank go to local heads [dst_head, ...) of a decode
    rank."""

    src_head: int
    dst_head: int
    count: int

    def to_proto(self) -> pb.HeadSlice:
        return pb.HeadSlice(src_head=self.src_head, dst_head=self.dst_head, count=self.count)

    @classmethod
    def from_proto(cls, msg: pb.HeadSlice) -> Slice:
        return cls(msg.src_head, msg.dst_head, msg.count)


@dataclass(frozen=True)
class Target:
    """What one prefill rank WRITEs into one decode rank."""

    pool: RankPool
    slices: tuple[Slice, ...]

    def whole_pages(self, src_heads: int) -> bool:
        """True when the slices are every head of both pools in the same order: whole pages can be copied."""
        return (len(self.slices) == 1 and self.slices[0] == Slice(0, 0, src_heads)
                and self.pool.layout.num_kv_heads == src_heads)

    def to_proto(self) -> pb.RankTarget:
        return pb.RankTarget(pool=self.pool.to_proto(), slices=[s.to_proto() for s in self.slices])

    @classmethod
    def from_proto(cls, msg: pb.RankTarget) -> Target:
        return cls(RankPool.from_proto(msg.pool), tuple(Slice.from_proto(s) for s in msg.slices))


def decode_pools(req: pb.RegisterDecodeRequest) -> tuple[list[RankPool], int]:
    """The decode's pools in rank order and the model's KV head count, from its registration."""
    if req.ranks:
        pools = [RankPool.from_proto(r) for r in req.ranks]
    else:
        pools = [RankPool(0, req.agent_name, req.agent_metadata, req.layout, range(req.layout.num_kv_heads))]
    return pools, req.total_kv_heads or req.layout.num_kv_heads


def _field(layout: pb.KVLayout, name: str):
    value = getattr(layout, name)
    return value if isinstance(value, (int, str)) else list(value)  # repeated: compared and named as a list


def pools_mismatch(prefill: list[RankPool], prefill_heads: int, decode: list[RankPool],
                   decode_heads: int) -> str | None:
    """Why these two sides' pools cannot exchange KV (naming the field and the decode rank), or None."""
    if decode_heads != prefill_heads:
        return f"KV layout mismatch: num_kv_heads is {decode_heads} on decode but {prefill_heads} on prefill"
    mine = prefill[0].layout
    for pool in decode:
        for name in RANK_MATCHED_FIELDS:
            theirs, ours = _field(pool.layout, name), _field(mine, name)
            if theirs != ours:
                where = f" (decode rank {pool.rank})" if len(decode) > 1 else ""
                return f"KV layout mismatch: {name} is {theirs!r} on decode{where} but {ours!r} on prefill"
        for name in ("k_regions", "v_regions"):
            regions = getattr(pool.layout, name)
            if len(regions) != mine.num_layers:
                return (f"KV layout mismatch: {name} of decode rank {pool.rank} has {len(regions)} entries, expected "
                        f"{mine.num_layers}")
            need = pool.layout.num_pages * KVLayout(**{f: getattr(pool.layout, f) for f in KV_LAYOUT_FIELDS}).page_bytes
            if any(r.length < need for r in regions):
                return (f"KV layout mismatch: {name} of decode rank {pool.rank} are shorter than num_pages "
                        f"({pool.layout.num_pages}) pages")
    covered = sorted(h for pool in decode for h in pool.heads)
    if set(covered) != set(range(decode_heads)) or any(p.heads.stop > decode_heads for p in decode):
        return (f"KV head mismatch: the decode ranks' KV heads {[(p.heads.start, p.heads.stop) for p in decode]} do "
                f"not cover the model's {decode_heads} heads exactly")
    if [p.rank for p in decode] != list(range(len(decode))):
        return f"KV head mismatch: decode ranks {[p.rank for p in decode]} are not 0..{len(decode) - 1}"
    return None


def plan_writes(prefill: list[RankPool], decode: list[RankPool]) -> dict[int, list[Target]]:
    """For every prefill rank, what it WRITEs: each decode head comes from exactly one prefill rank that holds it
    (with replicated heads, the holders take turns by decode rank), runs of adjacent heads merged into slices.
    Ranks with nothing to write map to an empty list. Assumes pools_mismatch() found nothing."""
    plan: dict[int, list[Target]] = {p.rank: [] for p in prefill}
    for dst in decode:
        per_source: dict[int, list[Slice]] = {}
        for dst_head, head in enumerate(dst.heads):
            holders = [p for p in prefill if head in p.heads]
            if not holders:
                raise ValueError(f"no prefill rank holds KV head {head}")
            src = holders[dst.rank % len(holders)]
            slices = per_source.setdefault(src.rank, [])
            src_head = src.heads.index(head)
            last = slices[-1] if slices else None
            if last is not None and last.src_head + last.count == src_head and last.dst_head + last.count == dst_head:
                slices[-1] = Slice(last.src_head, last.dst_head, last.count + 1)
            else:
                slices.append(Slice(src_head, dst_head, 1))
        for rank, slices in per_source.items():
            plan[rank].append(Target(dst, tuple(slices)))
    return plan


def plan_to_proto(engine_id: str, plan: dict[int, list[Target]]) -> pb.AddDecode:
    return pb.AddDecode(engine_id=engine_id, plans=[
        pb.RankPlan(prefill_rank=rank, targets=[t.to_proto() for t in targets]) for rank, targets in plan.items()])


@dataclass(frozen=True)
class RankWrite:
    """One decode rank a prefill rank WRITEs into, ready to post: whole pages when both pools hold the same heads
    (`slices` None: today's coalesced page runs), else head-sliced token rows."""

    remote: RemotePool
    remote_heads: int
    slices: tuple[tuple[int, int, int], ...] | None

    def post(self, backend: NixlBackend, src_pages: np.ndarray, dst_pages: np.ndarray):
        if self.slices is None:
            return backend.write_pages(self.remote, src_pages, dst_pages)
        return backend.write_head_slices(self.remote, self.remote_heads, src_pages, dst_pages, self.slices)


def rank_writes(targets: list[Target], local_heads: int, add_remote: Callable[[bytes], str]) -> list[RankWrite]:
    """A prefill rank's targets as writes, each decode rank's agent loaded with `add_remote` (which returns its
    name); raises ValueError when an agent's metadata names another agent than its registration claimed."""
    writes = []
    for target in targets:
        agent = add_remote(target.pool.agent_metadata)
        if agent != target.pool.agent_name:
            raise ValueError(f"decode rank {target.pool.rank}: agent_name {target.pool.agent_name!r} does not match "
                             f"its agent metadata's ({agent!r})")
        slices = None if target.whole_pages(local_heads) else tuple(
            (s.src_head, s.dst_head, s.count) for s in target.slices)
        writes.append(RankWrite(RemotePool.from_proto(agent, target.pool.layout), target.pool.layout.num_kv_heads,
                                slices))
    return writes
