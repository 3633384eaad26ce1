"""The expert-distribution recorder's WorkerAdmin calls in process (grpc.aio servers over in-process engines): a
recorded window counts every forwarded token top_k times per MoE layer and feeds tandem_expert_imbalance; a dense
model is FAILED_PRECONDITION; a data-parallel worker's proxy sums its replicas' dumps and lists each."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tandem.common.config import EngineConfig
from tandem.common.dp.admin_proxy import DPAdminProxy
from tandem.common.engine import Engine
from tandem.common.proto_gen.tandem import admin_pb2 as apb
from tandem.common.proto_gen.tandem import admin_pb2_grpc as apb_grpc
from tandem.common.rpc.admin_servicer import AdminServicer
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tandem.common.telemetry.metrics import WorkerMetrics

START, STOP, DUMP = (apb.StartExpertDistributionRecordRequest(), apb.StopExpertDistributionRecordRequest(),
                     apb.DumpExpertDistributionRecordRequest())


def make_engine(model_dir: str, metrics: WorkerMetrics) -> Engine:
    # The normal loop forwards exactly prompt + max_new - 1 tokens per request (the overlap loop launches one step
    # more, whose token is never used), so the counts are exact.
    return Engine(EngineConfig(model_path=model_dir, max_total_tokens=2048, page_size=4, max_context_len=1024,
                               event_loop="normal"), metrics=metrics)


@dataclass
class Worker:
    engine: Engine
    metrics: WorkerMetrics
    servicer: AdminServicer  # one per registry: it registers the control call metrics


@contextmanager
def worker(model_dir: str) -> Iterator[Worker]:
    metrics = WorkerMetrics("unified")
    with make_engine(model_dir, metrics) as engine:
        yield Worker(engine, metrics, AdminServicer(engine, metrics))


@pytest.fixture(scope="module")
def moe(model_factory):
    with worker(model_factory("qwen3_moe")) as w:
        yield w


@pytest.fixture(scope="module")
def moe_replica(model_factory):
    with worker(model_factory("qwen3_moe")) as w:
        yield w


@pytest.fixture(scope="module")
def dense(tiny_llama):
    with worker(tiny_llama) as w:
        yield w


def generate(engine: Engine, prompts: list[list[int]], max_new: int) -> int:
    """Greedy completions of `prompts` together; the tokens they forwarded (prompt + max_new - 1 each)."""
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    engine.generate([GenerateRequest(engine.new_rid(), ids, params) for ids in prompts])
    return sum(len(ids) + max_new - 1 for ids in prompts)


@asynccontextmanager
async def admin_channels(*servicers) -> AsyncIterator[list[grpc.aio.Channel]]:
    """Each servicer on its own grpc.aio server on 127.0.0.1:0; a channel to each."""
    servers, channels = [], []
    try:
        for servicer in servicers:
            server = grpc.aio.server()
            apb_grpc.add_WorkerAdminServicer_to_server(servicer, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            servers.append(server)
            channels.append(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
        yield channels
    finally:
        for channel in channels:
            await channel.close()
        for server in servers:
            await server.stop(None)


@asynccontextmanager
async def admin_server(*servicers) -> AsyncIterator[list[apb_grpc.WorkerAdminStub]]:
    async with admin_channels(*servicers) as channels:
        yield [apb_grpc.WorkerAdminStub(channel) for channel in channels]


def sample(metrics: WorkerMetrics, name: str, **labels) -> float:
    text = generate_latest(metrics.registry).decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_a_window_counts_each_forwarded_token_top_k_times_per_moe_layer(moe):
    engine, metrics = moe.engine, moe.metrics
    moe_config = engine.model_config.moe

    async def scenario():
        async with admin_server(moe.servicer) as [stub]:
            await asyncio.to_thread(generate, engine, [[3, 1, 4, 1, 5]], 3)  # before the window: not counted
            assert (await stub.StartExpertDistributionRecord(START, timeout=10)).success
            tokens = await asyncio.to_thread(generate, engine, [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23]], 5)
            assert json.loads((await stub.DumpExpertDistributionRecord(DUMP, timeout=10)).dump_json)["recording"]
            stop = await stub.StopExpertDistributionRecord(STOP, timeout=10)
            await asyncio.to_thread(generate, engine, [[31, 32, 33, 34]], 3)  # after the window: not counted
            reply = await stub.DumpExpertDistributionRecord(DUMP, timeout=10)
            return tokens, stop, reply
    tokens, stop, reply = asyncio.run(scenario())
    assert stop.success and stop.message == "expert distribution recording stopped"
    dump = json.loads(reply.dump_json)
    assert reply.success and reply.message == f"{dump['num_steps']} forward pass(es) recorded"
    assert dump["mode"] == "stat" and not dump["recording"] and dump["num_steps"] > 0
    assert len(dump["logical_count"]) == len(moe_config.layers)
    for layer in dump["logical_count"]:
        assert len(layer) == moe_config.num_experts and sum(layer) == tokens * moe_config.top_k
    # One imbalance observation per MoE layer and recorded pass (one EP rank: always balanced, 1.0).
    for layer in moe_config.layers:
        labels = {"role": "unified", "layer": str(layer)}
        assert sample(metrics, "tandem_expert_imbalance_count", **labels) == dump["num_steps"]
        assert sample(metrics, "tandem_expert_imbalance_sum", **labels) == pytest.approx(dump["num_steps"])
    assert sample(metrics, "tandem_control_calls_total", call="dump_expert_distribution_record", outcome="ok") == 2


def test_start_restarts_the_window_from_zero(moe):
    engine = moe.engine

    async def scenario():
        async with admin_server(moe.servicer) as [stub]:
            await stub.StartExpertDistributionRecord(START, timeout=10)
            await asyncio.to_thread(generate, engine, [[41, 42, 43, 44, 45]], 2)
            await stub.StartExpertDistributionRecord(START, timeout=10)
            first = json.loads((await stub.DumpExpertDistributionRecord(DUMP, timeout=10)).dump_json)
            await stub.StopExpertDistributionRecord(STOP, timeout=10)
            return first
    dump = asyncio.run(scenario())
    assert dump["recording"] and dump["num_steps"] == 0
    assert all(count == 0 for layer in dump["logical_count"] for count in layer)


def test_a_dense_model_is_failed_precondition(dense):
    async def scenario():
        async with admin_server(dense.servicer) as [stub]:
            errors = []
            for method, request in (("StartExpertDistributionRecord", START), ("StopExpertDistributionRecord", STOP),
                                    ("DumpExpertDistributionRecord", DUMP)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await getattr(stub, method)(request, timeout=10)
                errors.append(info.value)
            return errors
    for error in asyncio.run(scenario()):
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "is a dense model: it has no experts to record" in error.details()
    assert sample(dense.metrics, "tandem_control_calls_total", call="start_expert_distribution_record",
                  outcome="refused") == 1


def test_a_data_parallel_worker_sums_its_replicas_and_lists_each(moe, moe_replica):
    first, second = moe.engine, moe_replica.engine

    async def scenario():
        async with admin_channels(moe.servicer, moe_replica.servicer) as replicas:
            async with admin_server(DPAdminProxy(replicas)) as [stub]:
                assert (await stub.StartExpertDistributionRecord(START, timeout=10)).success
                tokens = [await asyncio.to_thread(generate, first, [[51, 52, 53, 54, 55, 56]], 4),
                          await asyncio.to_thread(generate, second, [[61, 62, 63]], 2)]
                assert (await stub.StopExpertDistributionRecord(STOP, timeout=10)).success
                return tokens, await stub.DumpExpertDistributionRecord(DUMP, timeout=10)
    tokens, reply = asyncio.run(scenario())
    dump, top_k = json.loads(reply.dump_json), first.model_config.moe.top_k
    assert reply.success and reply.message.endswith("over 2 replicas")
    assert [sum(r["logical_count"][0]) for r in dump["replicas"]] == [t * top_k for t in tokens]
    assert dump["num_steps"] == sum(r["num_steps"] for r in dump["replicas"]) > 0
    assert dump["logical_count"] == [[a + b for a, b in zip(x, y)] for x, y in
                                     zip(*(r["logical_count"] for r in dump["replicas"]))]
    assert not dump["recording"]


def test_a_data_parallel_dense_worker_names_the_refusing_replica(dense):
    async def scenario():
        async with admin_channels(dense.servicer) as replicas:
            async with admin_server(DPAdminProxy(replicas)) as [stub]:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.DumpExpertDistributionRecord(DUMP, timeout=10)
                return info.value
    error = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error.details().startswith("data-parallel replica 0: dump_expert_distribution_record: ")
