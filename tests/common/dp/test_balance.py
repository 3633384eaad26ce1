"""The data-parallel controller's choice of replica for each balance method, with fake loads."""

from __future__ import annotations

import pytest

from tandem.common.config import ConfigError, EngineConfig, TransferFlags
from tandem.common.dp.balance import DPBalancer, ReplicaLoad


def test_round_robin_cycles_over_live_replicas():
    balancer = DPBalancer(3, "round_robin")
    assert [balancer.dispatch(f"r{i}", 1, 10) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    balancer.mark_dead(1)
    assert {balancer.dispatch(f"s{i}", 1, 10) for i in range(4)} == {0, 2}


def test_shortest_queue_picks_fewest_requests():
    balancer = DPBalancer(3, "shortest_queue")
    loads = [ReplicaLoad(requests=4, tokens=10), ReplicaLoad(requests=1, tokens=900), ReplicaLoad(requests=2)]
    assert balancer.choose(loads) == 1
    loads[1].alive = False
    assert balancer.choose(loads) == 2


def test_minimum_tokens_picks_fewest_reserved_tokens():
    balancer = DPBalancer(3, "minimum_tokens")
    loads = [ReplicaLoad(requests=1, tokens=500), ReplicaLoad(requests=9, tokens=100), ReplicaLoad(tokens=300)]
    assert balancer.choose(loads) == 1


def test_dispatch_counts_load_until_finish():
    """A long request (many tokens) on rank 0 sends the next ones elsewhere under minimum_tokens; its finish
    frees the rank again. n sequences count n times under shortest_queue."""
    balancer = DPBalancer(2, "minimum_tokens")
    assert balancer.dispatch("long", 1, 1000) == 0
    assert [balancer.dispatch(f"short{i}", 1, 50) for i in range(3)] == [1, 1, 1]
    balancer.finish("long")
    assert balancer.loads[0] == ReplicaLoad(0, 0) and balancer.rank_of("long") is None
    assert balancer.dispatch("next", 1, 50) == 0
    queue = DPBalancer(2, "shortest_queue")
    assert queue.dispatch("n4", 4, 40) == 0
    assert [queue.dispatch(f"q{i}", 1, 10) for i in range(4)] == [1, 1, 1, 1]
    assert queue.rank_of("n4") == 0 and queue.loads[0].requests == 4


def test_bad_method_duplicate_rid_and_dead_replicas_are_errors():
    with pytest.raises(ValueError, match="--load-balance-method must be one of"):
        DPBalancer(2, "random")
    balancer = DPBalancer(1, "round_robin")
    balancer.dispatch("a", 1, 1)
    with pytest.raises(ValueError, match="already in flight"):
        balancer.dispatch("a", 1, 1)
    balancer.mark_dead(0)
    with pytest.raises(RuntimeError, match="no data-parallel replica is alive"):
        balancer.dispatch("b", 1, 1)


def test_config_checks(tiny_llama):
    EngineConfig(model_path=tiny_llama, dp_size=2, load_balance_method="minimum_tokens").validate()
    with pytest.raises(ConfigError, match="--load-balance-method must be one of"):
        EngineConfig(model_path=tiny_llama, dp_size=2, load_balance_method="random").validate()
    with pytest.raises(ConfigError, match="--dp-size must be >= 1"):
        EngineConfig(model_path=tiny_llama, dp_size=0).validate()


def test_pd_replica_flags_parse_and_give_each_replica_its_own_engine_id(tiny_llama):
    """A prefill/decode replica gets the worker's KV-transfer flags, an engine id of its own (a prefill tells decodes
    apart by it) and, for a prefill, a free bootstrap port (the worker's port is the proxy's); its whole command
    line parses with the role's own parser."""
    import argparse

    from tandem.common.dp.replicas import replica_command
    from tandem.common.dp.serve import DPRole
    from tandem.common.config import WorkerConfig
    from tandem.common.flags import from_flags
    from tandem.common.roles import Role
    from tandem.services.decode.main import register as register_decode
    from tandem.services.prefill.main import register as register_prefill

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    register_prefill(sub)
    register_decode(sub)
    config = EngineConfig(model_path=tiny_llama, dp_size=2)
    flags = TransferFlags(bootstrap_timeout=7.0, bootstrap_port=8100, allowed_bootstrap=None)
    for role, extra in ((Role.PREFILL, {}), (Role.DECODE, {"allowed_bootstrap": ("10.0.0.1:8100",)})):
        dp_role = DPRole(role, TransferFlags(**{**flags.__dict__, **extra}), "pd-1", "127.0.0.1", 8100)
        for rank in range(2):
            argv, _ = replica_command(config, WorkerConfig(), rank, None, dp_role.replica_argv)
            args = parser.parse_args(argv[3:])  # after `python -m tandem.common.cli`
            assert (args.engine_id, args.bootstrap_timeout, args.dp_size) == (f"pd-1-dp{rank}", 7.0, 1)
            if role is Role.PREFILL:
                assert args.bootstrap_port == 0
            else:
                allowed = from_flags(TransferFlags, args).allowed_bootstrap
                assert allowed == ("10.0.0.1:8100",) and "--bootstrap-port" not in argv


def test_replicas_on_cuda_each_see_their_own_gpus(tiny_llama):
    """Replica r of a --dp-size worker on CUDA gets the r-th group of tp x pp GPUs (as CUDA_VISIBLE_DEVICES, within
    the worker's own), so replicas never share a device; too few GPUs is a start-up error."""
    from tandem.common.dp.replicas import replica_gpus

    config = EngineConfig(model_path=tiny_llama, dp_size=2, device="cuda")
    assert [replica_gpus(config, r, None) for r in range(2)] == ["0", "1"]
    assert [replica_gpus(config, r, "4,5,6") for r in range(2)] == ["4", "5"]
    assert replica_gpus(EngineConfig(model_path=tiny_llama, dp_size=2, device="cuda:1"), 1, None) == "2"
    assert replica_gpus(EngineConfig(model_path=tiny_llama, dp_size=2), 1, "0,1") is None  # CPU
    with pytest.raises(ConfigError, match="needs 2 GPUs"):
        replica_gpus(config, 1, "3")


def test_a_tensor_parallel_decode_replica_on_cuda_gets_tp_gpus_and_keeps_its_tp_size(tiny_llama, monkeypatch):
    """--dp-size 2 --tp-size 2 on a decode: replica 1 sees GPUs 2 and 3 only (its ranks number them cuda:0 and
    cuda:1) and runs `decode --tp-size 2 --dp-size 1` with its own engine id."""
    from tandem.common.config import WorkerConfig
    from tandem.common.dp.replicas import replica_command, replica_gpus
    from tandem.common.dp.serve import DPRole
    from tandem.common.roles import Role

    config = EngineConfig(model_path=tiny_llama, dp_size=2, tp_size=2, device="cuda")
    assert [replica_gpus(config, r, None) for r in range(2)] == ["0,1", "2,3"]
    assert replica_gpus(config, 1, "7,6,5,4") == "5,4"
    with pytest.raises(ConfigError, match="--dp-size 2 x --tp-size 2 x --pp-size 1 needs 4 GPUs"):
        replica_gpus(config, 1, "0,1,2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    argv, env = replica_command(config, WorkerConfig(), 1, None, DPRole(Role.DECODE, TransferFlags(), "d").replica_argv)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert argv[3] == "decode" and argv[argv.index("--engine-id") + 1] == "d-dp1"
    assert argv[argv.index("--tp-size") + 1] == "2" and argv[argv.index("--dp-size") + 1] == "1"
    assert argv[argv.index("--device") + 1] == "cuda"


def test_room_ranks_wait_for_the_leg_then_fall_back_to_room_mod_dp_size():
    """The bootstrap proxy's map: a destination waits for its room's prefill leg and then goes where the controller
    placed it; one whose leg does not come in time goes to room % dp_size, and the leg must follow that binding."""
    import asyncio

    from tandem.common.dp.bootstrap_proxy import RoomRanks

    async def main():
        rooms = RoomRanks(2)
        waiting = asyncio.create_task(rooms.rank_of(10, wait_s=5))
        await asyncio.sleep(0.01)
        rooms.bind(10, 1)  # the leg arrived and the balancer chose rank 1 (not 10 % 2)
        assert await waiting == 1
        assert await rooms.rank_of(7, wait_s=0.01) == 1 and rooms.bound(7) == 1  # no leg: 7 % 2, bound

    asyncio.run(main())
