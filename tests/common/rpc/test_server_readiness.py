"""A worker is ready (health SERVING, HealthCheck healthy, the 'listening' line) only once its start-up warm-up (the
grammar backend) has ended; a stop while it loads drains at once. Each scenario runs `serve` in a child process of
its own (grpc.aio's poller thread would outlive it in the pytest process) over a real engine, with a warm-up the
test ends itself."""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import os
import subprocess
import sys
from contextlib import redirect_stdout

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


async def _states(port: int) -> tuple[bool, str, int]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        reply = await pb_grpc.SglangSchedulerStub(channel).HealthCheck(pb.HealthCheckRequest(), timeout=20)
        try:
            status = (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)).status
        except grpc.aio.AioRpcError as e:  # a service whose status was never set is NOT_FOUND
            status = -e.code().value[0]
        return reply.healthy, reply.message, status


async def _scenario(servicer, port: int, finish_warm_up: bool) -> str:
    from tandem.common.rpc.server import serve

    out = io.StringIO()
    stop = asyncio.Event()
    with redirect_stdout(out):
        task = asyncio.ensure_future(serve(servicer, "127.0.0.1", port, drain_timeout_s=1.0, stop=stop))
        healthy, message, status = await _states(port)
        assert not healthy and "grammar" in message, message
        assert status != health_pb2.HealthCheckResponse.SERVING
        assert "listening on" not in out.getvalue()
        if finish_warm_up:
            servicer.warming.set_result(None)
            for _ in range(100):
                healthy, _, status = await _states(port)
                if healthy and status == health_pb2.HealthCheckResponse.SERVING:
                    break
                await asyncio.sleep(0.1)
            assert healthy and status == health_pb2.HealthCheckResponse.SERVING
            assert f"listening on 127.0.0.1:{port}" in out.getvalue()
        stop.set()
        await asyncio.wait_for(task, 30)  # a stop while warming up drains without waiting for the warm-up
    if not finish_warm_up:
        assert "listening on" not in out.getvalue()
    return "ok"


def child(model_dir: str, port: int, finish_warm_up: bool) -> None:
    from tandem.common.config import EngineConfig
    from tandem.common.engine import Engine
    from tandem.common.rpc.servicer import WorkerInfo
    from tandem.common.rpc.unified_worker import UnifiedServicer
    from tandem.common.telemetry.metrics import WorkerMetrics

    config = EngineConfig(model_path=model_dir, max_total_tokens=1024, page_size=4, max_context_len=512)
    with Engine(config) as engine:
        servicer = UnifiedServicer(engine, WorkerInfo("tiny"), WorkerMetrics.off("unified"))
        servicer.warming = concurrent.futures.Future()  # the grammar backend "loading" until the scenario ends it
        print("scenario:", asyncio.run(_scenario(servicer, port, finish_warm_up)), flush=True)


def _run(model_dir: str, finish_warm_up: bool) -> None:
    from tandem.common.launcher.children import free_port

    code = (f"from tests.common.rpc.test_server_readiness import child; "
            f"child({model_dir!r}, {free_port()}, {finish_warm_up})")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and "scenario: ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_ready_only_after_the_warm_up_ends(tiny_llama):
    _run(tiny_llama, finish_warm_up=True)


def test_a_stop_while_warming_up_drains_without_waiting_for_it(tiny_llama):
    _run(tiny_llama, finish_warm_up=False)
