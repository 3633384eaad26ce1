"""In-process pieces of the KV transfer layer: page indices, layout checks, metadata, the bench command."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from tandem.common.transfer.messages import KVLayout, KVTransferMetadata, TransferConfig
from tandem.common.transfer import bench
from tandem.common.transfer.rank_plan import RankPool, pools_mismatch
from tandem.common.transfer.nixl_backend import _page_indices


def test_page_indices_name_each_page_in_every_buffer_of_the_prepped_list():
    # 2 buffers (K and V of one layer) of 10 pages: descriptor buffer * 10 + page
    assert _page_indices(np.array([3, 4, 9]), 2, 10, "source").tolist() == [3, 4, 9, 13, 14, 19]
    for bad in ([10], [-1]):  # would address another buffer's page, or none
        with pytest.raises(ValueError, match=r"destination pages must lie in \[0, 10\)"):
            _page_indices(np.array(bad), 2, 10, "destination")


def _proto(layout: KVLayout):
    from tandem.common.proto_gen.tandem import bootstrap_pb2 as pb

    region = pb.MemoryRegion(address=4096, length=layout.num_pages * layout.page_bytes)
    return pb.KVLayout(num_layers=layout.num_layers, page_size=layout.page_size, num_kv_heads=layout.num_kv_heads,
                       head_dim=layout.head_dim, dtype=layout.dtype, num_pages=layout.num_pages,
                       k_regions=[region] * layout.num_layers, v_regions=[region] * layout.num_layers)


@pytest.mark.parametrize("field,value", [("num_layers", 3), ("page_size", 8), ("num_kv_heads", 1),
                                         ("head_dim", 16), ("dtype", "bfloat16")])
def test_layout_mismatch_names_the_field(field, value):
    def mismatch(mine: KVLayout, theirs: KVLayout) -> str | None:
        prefill = [RankPool(0, "p", b"", _proto(mine), range(mine.num_kv_heads))]
        decode = [RankPool(0, "d", b"", _proto(theirs), range(theirs.num_kv_heads))]
        return pools_mismatch(prefill, mine.num_kv_heads, decode, theirs.num_kv_heads)

    mine = KVLayout(2, 4, 2, 8, "float32", 32)
    theirs = KVLayout(**{**vars(mine), field: value})
    assert mismatch(mine, mine) is None
    assert mismatch(mine, KVLayout(**{**vars(mine), "num_pages": 64})) is None  # pool sizes may differ
    assert field in mismatch(mine, theirs)


def test_metadata_round_trips_through_protobuf():
    meta = KVTransferMetadata(room=2**62 + 5, first_token_id=17, first_token_logprob=-0.5, top_logprobs=[(17, -0.5), (3, -2.0)],
                              cached_tokens=32, prompt_tokens=100, ok=False, error="boom")
    assert KVTransferMetadata.from_proto(meta.to_proto()) == meta


def test_config_rejects_nonsense():
    with pytest.raises(ValueError, match="heartbeat_interval_s"):
        TransferConfig(heartbeat_interval_s=0)


@pytest.mark.e2e
def test_bench_kv_runs_and_writes_json(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers(dest="bench_command"))
    out = tmp_path / "kv.json"
    args = parser.parse_args(["kv", "--tokens", "64,100", "--repeats", "2", "--layers", "2", "--scattered", "--output", str(out)])
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert [r["tokens"] for r in result["results"]] == [64, 100]
    assert all(r["nixl_gbps_median"] > 0 and r["copy_gbps_median"] > 0 and r["memcpy_gbps_median"] > 0
               for r in result["results"])
    assert "NIXL WRITE" in capsys.readouterr().out
