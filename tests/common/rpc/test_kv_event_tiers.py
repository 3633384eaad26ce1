"""KV events name the tier a page copy was stored in or removed from (HiCache), as smg's KvCacheTier."""

from smg_grpc_proto.generated import common_pb2

from tandem.common.memory.cache_events import BlockRemoved, BlockStored
from tandem.common.rpc.kv_events import event_to_proto


def test_each_tier_maps_to_the_proto_enum():
    tiers = {"device": common_pb2.KV_CACHE_TIER_DEVICE, "host": common_pb2.KV_CACHE_TIER_HOST,
             "disk": common_pb2.KV_CACHE_TIER_DISK}
    for name, value in tiers.items():
        stored = event_to_proto(BlockStored([11], None, [1, 2], 2, tier=name), 1)
        assert stored.stored.tier == value
        removed = event_to_proto(BlockRemoved([11], tier=name), 2)
        assert removed.removed.tier == value and list(removed.removed.block_hashes) == [11]


def test_the_tier_defaults_to_the_device():
    assert event_to_proto(BlockStored([1], None, [1], 1), 1).stored.tier == common_pb2.KV_CACHE_TIER_DEVICE
    assert event_to_proto(BlockRemoved([1]), 1).removed.tier == common_pb2.KV_CACHE_TIER_DEVICE
