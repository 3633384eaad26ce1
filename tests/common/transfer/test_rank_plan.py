"""The write plan between a prefill and a decode at tensor-parallel sizes of their own, and the registration check
that refuses pools which cannot exchange KV."""

from __future__ import annotations

import pytest

from tandem.common.proto_gen.tandem import bootstrap_pb2 as pb
from tandem.common.transfer.messages import KVLayout
from tandem.common.transfer.rank_plan import (
    KV_LAYOUT_FIELDS,
    RankPool,
    Slice,
    decode_pools,
    plan_writes,
    pools_mismatch,
)


def kv_heads(rank: int, size: int, total: int) -> range:
    """TPShard.kv_heads: sharded when total >= size, else replicated."""
    if total >= size:
        per = total // size
        return range(rank * per, (rank + 1) * per)
    head = rank * total // size
    return range(head, head + 1)


def pools(size: int, total: int, page_size: int = 4, dtype: str = "float32", layers: int = 2) -> list[RankPool]:
    out = []
    for rank in range(size):
        heads = kv_heads(rank, size, total)
        region = pb.MemoryRegion(address=4096 * (rank + 1), length=64 * page_size * len(heads) * 8 * 4)
        layout = pb.KVLayout(num_layers=layers, page_size=page_size, num_kv_heads=len(heads), head_dim=8, dtype=dtype,
                             num_pages=64, k_regions=[region] * layers, v_regions=[region] * layers)
        out.append(RankPool(rank, f"agent-{rank}", b"", layout, heads))
    return out


@pytest.mark.parametrize("total", [2, 4])
@pytest.mark.parametrize("prefill_tp", [1, 2, 4])
@pytest.mark.parametrize("decode_tp", [1, 2, 4])
def test_every_decode_head_is_written_once_from_a_prefill_rank_that_holds_it(prefill_tp, decode_tp, total):
    prefill, decode = pools(prefill_tp, total), pools(decode_tp, total)
    assert pools_mismatch(prefill, total, decode, total) is None
    plan = plan_writes(prefill, decode)
    written = {d.rank: [] for d in decode}
    for src_rank, targets in plan.items():
        src = prefill[src_rank]
        for target in targets:
            for s in target.slices:
                for i in range(s.count):
                    global_head = src.heads[s.src_head + i]
                    assert target.pool.heads[s.dst_head + i] == global_head  # the right offset on the decode
                    written[target.pool.rank].append(global_head)
    assert {rank: sorted(heads) for rank, heads in written.items()} == {d.rank: list(d.heads) for d in decode}


def test_same_tp_writes_rank_to_rank_whole_pages():
    plan = plan_writes(pools(2, 4), pools(2, 4))
    assert [[(t.pool.rank, t.whole_pages(2)) for t in plan[r]] for r in (0, 1)] == [[(0, True)], [(1, True)]]


def test_prefill_tp2_into_decode_tp1_slices_heads_at_their_offsets():
    plan = plan_writes(pools(2, 4), pools(1, 4))
    assert [(t.pool.rank, t.slices) for t in plan[0]] == [(0, (Slice(0, 0, 2),))]
    assert [(t.pool.rank, t.slices) for t in plan[1]] == [(0, (Slice(0, 2, 2),))]
    assert not plan[1][0].whole_pages(2)


def test_replicated_heads_are_written_by_one_holder_each():
    """2 KV heads at prefill TP 4: ranks 0-1 hold head 0, ranks 2-3 head 1; decode TP 2 takes head 0 from rank 0
    and head 1 from rank 3 (holders take turns by decode rank), the others write nothing."""
    plan = plan_writes(pools(4, 2), pools(2, 2))
    assert {r: [(t.pool.rank, t.slices) for t in ts] for r, ts in plan.items()} == {
        0: [(0, (Slice(0, 0, 1),))], 1: [], 2: [], 3: [(1, (Slice(0, 0, 1),))]}


@pytest.mark.parametrize("change,message", [
    (lambda d: d[1].layout.__setattr__("page_size", 8), "page_size is 8 on decode (decode rank 1) but 4 on prefill"),
    (lambda d: d[0].layout.__setattr__("dtype", "bfloat16"), "dtype is 'bfloat16' on decode (decode rank 0)"),
    (lambda d: d[1].layout.__setattr__("num_layers", 3), "num_layers is 3 on decode (decode rank 1)"),
    (lambda d: d.pop(), "do not cover the model's 2 heads exactly"),
])
def test_impossible_combinations_are_named(change, message):
    decode = pools(2, 2)
    change(decode)
    assert message in pools_mismatch(pools(1, 2), 2, decode, 2)


def test_fp8_pools_must_agree_on_dtype_and_scales_naming_both_sides():
    prefill, decode = pools(1, 2, dtype="float8_e4m3fn"), pools(2, 2, dtype="float8_e4m3fn")
    for pool in prefill + decode:
        pool.layout.k_scales[:] = [0.5, 1.0]
        pool.layout.v_scales[:] = [0.25, 1.0]
    assert pools_mismatch(prefill, 2, decode, 2) is None
    decode[1].layout.v_scales[:] = [0.25, 2.0]
    assert pools_mismatch(prefill, 2, decode, 2) == \
        "KV layout mismatch: v_scales is [0.25, 2.0] on decode (decode rank 1) but [0.25, 1.0] on prefill"
    assert pools_mismatch(prefill, 2, pools(2, 2), 2) == \
        "KV layout mismatch: dtype is 'float32' on decode (decode rank 0) but 'float8_e4m3fn' on prefill"
    fp8 = pools(1, 2, dtype="float8_e4m3fn")[0].layout
    assert KVLayout(**{f: getattr(fp8, f) for f in KV_LAYOUT_FIELDS}).page_bytes == 4 * 2 * 8  # page 4, 2 heads, dim 8: one byte a value


def test_different_head_counts_are_refused():
    assert pools_mismatch(pools(2, 4), 4, pools(2, 2), 2) == \
        "KV layout mismatch: num_kv_heads is 2 on decode but 4 on prefill"


def test_registration_without_ranks_is_one_pool_of_every_head():
    layout = pools(1, 2)[0].layout
    req = pb.RegisterDecodeRequest(engine_id="d", agent_name="a", agent_metadata=b"m", layout=layout)
    [pool], total = decode_pools(req)
    assert (pool.agent_name, pool.heads, total) == ("a", range(2), 2)
    ranks = [p.to_proto() for p in pools(2, 2)]
    got, total = decode_pools(pb.RegisterDecodeRequest(layout=ranks[0].layout, total_kv_heads=2, ranks=ranks))
    assert [(p.rank, p.heads) for p in got] == [(0, range(0, 1)), (1, range(1, 2))] and total == 2
