"""`tandem worker --dp-size 2 --pp-size 2`: two replica processes, each a two-stage pipeline, give one engine's
greedy ids and both serve; in-process replicas of a pipeline are refused."""

from __future__ import annotations

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tandem.common.config import EngineConfig
from tandem.common.dp.engine_pool import DataParallelEngine
from tandem.common.engine import Engine
from tandem.common.flags import ConfigError
from tests.common.dp.test_dp_worker import PROMPTS, _generate, _wait_idle_all
from tests.common.rpc.helpers import WorkerProcess, engine_greedy


@pytest.mark.e2e
def test_dp2_of_pp2_pipelines_matches_one_engine_and_uses_both_replicas(tiny_llama):
    worker = WorkerProcess(tiny_llama, "--dp-size", "2", "--pp-size", "2", "--load-balance-method", "round_robin",
                           "--num-threads", "1", "--dist-timeout", "10", timeout=240, wait=False)
    try:
        config = EngineConfig(model_path=tiny_llama, max_total_tokens=2048, page_size=4, max_context_len=1024)
        with Engine(config) as engine:  # while the worker loads
            expected = [engine_greedy(engine, p, 6).sequences[0].output_ids for p in PROMPTS]
        worker.wait_ready()
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.SglangSchedulerStub(channel)
            got = [_generate(stub, f"g{i}", p, max_new_tokens=6) for i, p in enumerate(PROMPTS)]
            assert got == expected
            loads = _wait_idle_all(stub)  # nothing running or holding pages on either replica
            assert loads.dp_rank_count == 2 and [x.dp_rank for x in loads.loads] == [0, 1]
            # Round robin: each replica's pipeline served 3 prompts and cached them in its own RadixCache.
            assert all(x.token_usage > 0 for x in loads.loads)
            info = stub.GetServerInfo(pb.GetServerInfoRequest())
            assert info.server_args["dp_size"] == 2
            assert _stage_workers_under(worker.proc.pid) == 2  # stage 1 of each replica's pipeline
    finally:
        code = worker.stop()
    assert code == 0  # the controller and its replicas stopped cleanly on SIGTERM


def _stage_workers_under(pid: int) -> int:
    """Pipeline stage processes among `pid`'s descendants."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    count = 0
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            count += b"tandem.common.model.parallel.stage_worker" in f.read()
        count += _stage_workers_under(child)
    return count


def test_in_process_replicas_of_a_pipeline_are_refused(tiny_llama):
    with pytest.raises(ConfigError, match="--dp-size 2 with --pp-size 2: in-process replicas of a pipeline"):
        DataParallelEngine(EngineConfig(model_path=tiny_llama, dp_size=2, pp_size=2))
