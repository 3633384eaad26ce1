"""A router (Gateway + GrpcApi) in front of a worker serving an in-process Engine, all on one event loop of the
test process: the router's front ends tested without starting processes."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tandem.common.proto_gen.tandem import router_pb2_grpc as rpb_grpc
from tandem.common.roles import Role
from tandem.common.rpc.server import WorkerServer
from tandem.common.rpc.servicer import WorkerInfo
from tandem.common.rpc.unified_worker import UnifiedServicer
from tandem.common.telemetry.metrics import WorkerMetrics
from tandem.services.router.config import RouterConfig, WorkerEndpoint
from tandem.services.router.gateway import Gateway
from tandem.services.router.grpc_api import GrpcApi

MAX_CONTEXT_LEN = 1024


def engine_config(model_dir: str):
    from tandem.common.config import EngineConfig

    return EngineConfig(model_path=model_dir, max_total_tokens=4096, page_size=4, max_context_len=MAX_CONTEXT_LEN)


@dataclass
class Stack:
    gateway: Gateway
    api: GrpcApi
    worker: WorkerServer
    servicer: UnifiedServicer
    stub: rpb_grpc.RouterStub  # the router's gRPC API, as a client sees it
    channel: grpc.aio.Channel
    worker_stub: pb_grpc.SglangSchedulerStub  # the worker, as the router reaches it

    async def settled(self, timeout: float = 10.0) -> pb.SchedulerLoad:
        """Until the router holds no admitted request and the worker has none in flight, running or waiting, and
        no KV held by one. A cancelled or expired call settles in steps (the router stops its leg, the worker
        aborts it, the router's handler releases its admission), in whatever order the two loops reach them."""
        deadline = time.monotonic() + timeout
        while self.gateway.admission.running:
            assert time.monotonic() < deadline, "the router still holds an admitted request"
            await asyncio.sleep(0.02)
        while True:
            load = (await self.worker_stub.GetLoads(pb.GetLoadsRequest(include=["all"]), timeout=5)).loads[0]
            if (not self.servicer.in_flight and load.num_running_reqs == 0 and load.num_waiting_reqs == 0
                    and load.num_used_tokens == 0):
                return load
            assert time.monotonic() < deadline, f"worker still busy: {self.servicer.in_flight} {load}"
            await asyncio.sleep(0.02)


@asynccontextmanager
async def router_stack(engine, model_dir: str, **router_flags) -> AsyncIterator[Stack]:
    """A worker server over `engine` on 127.0.0.1:0, a router with a model path (its tokenizer) in front of it,
    the router's gRPC API on 127.0.0.1:0 and a channel to it; everything is stopped on leaving."""
    metrics = WorkerMetrics.off(Role.UNIFIED)
    servicer = UnifiedServicer(engine, WorkerInfo("tiny", server_args={"generate_stream": True}), metrics)
    worker = WorkerServer(servicer, "127.0.0.1", 0)
    port = await worker.start()
    await worker.set_serving()
    flags = dict(served_model_name="tiny", health_check_interval_s=0.05, load_poll_interval_s=0.05,
                 tokenize_threads=1, **router_flags)
    gateway = Gateway(RouterConfig(workers=[WorkerEndpoint(Role.UNIFIED, "127.0.0.1", port)], model_path=model_dir,
                                   **flags))
    api = GrpcApi(gateway)
    try:
        await gateway.start()
        deadline = time.monotonic() + 10
        while not gateway.ready()[0]:
            assert time.monotonic() < deadline, gateway.ready()[1]
            await asyncio.sleep(0.01)
        grpc_port = await api.start("127.0.0.1", 0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            worker_stub = next(iter(gateway.registry.workers.values())).stub
            yield Stack(gateway, api, worker, servicer, rpb_grpc.RouterStub(channel), channel, worker_stub)
    finally:
        await api.stop()
        await gateway.stop()
        await worker.drain(0.0)


def threads_settle(before: set[threading.Thread], timeout: float = 5.0) -> list[str]:
    """Names of threads started since `before` that are still alive after `timeout` (grpc.aio's poller ends once
    its last server and channel are collected; the tokenize pool's threads once they see the shutdown)."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        left = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)
