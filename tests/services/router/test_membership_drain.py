"""Removing a worker at run time with requests streaming on it (DELETE /workers, in process, real workers over
an in-process Engine): every stream finishes whole, the answer comes once they did, and new requests go to the
worker added at run time (POST /workers)."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tandem.common.roles import Role
from tandem.common.rpc.server import WorkerServer
from tandem.common.rpc.servicer import WorkerInfo
from tandem.common.rpc.unified_worker import UnifiedServicer
from tandem.common.telemetry.metrics import WorkerMetrics
from tandem.services.router.config import RouterConfig, WorkerEndpoint
from tandem.services.router.gateway import Gateway
from tandem.services.router.http_api import build_app
from tests.services.router.in_process import engine_config

ADMIN = {"Authorization": "Bearer admin-secret"}
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def engine(tiny_llama):
    from tandem.common.engine import Engine

    with Engine(engine_config(tiny_llama)) as engine:
        yield engine


async def start_worker(engine) -> tuple[WorkerServer, UnifiedServicer, int]:
    servicer = UnifiedServicer(engine, WorkerInfo("tiny", server_args={"generate_stream": True}),
                               WorkerMetrics.off(Role.UNIFIED))
    server = WorkerServer(servicer, "127.0.0.1", 0)
    port = await server.start()
    await server.set_serving()
    return server, servicer, port


async def stream_completion(client: TestClient, prompt: str) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    usage, finish, done = None, None, False
    async for raw in resp.content:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            usage = chunk.get("usage") or usage
            finish = next((c["finish_reason"] for c in chunk["choices"] if c.get("finish_reason")), finish)
    return {"done": done, "finish": finish, "tokens": usage and usage["completion_tokens"]}


def test_removing_a_worker_drains_its_streams_and_new_requests_go_to_the_added_one(engine, tiny_llama):
    async def run():
        first, first_servicer, first_port = await start_worker(engine)
        second, second_servicer, second_port = await start_worker(engine)
        config = RouterConfig(workers=[WorkerEndpoint(Role.UNIFIED, "127.0.0.1", first_port)], model_path=tiny_llama,
                              served_model_name="tiny", admin_api_key="admin-secret", health_check_interval_s=0.05,
                              load_poll_interval_s=0.05, tokenize_threads=1)
        gateway = Gateway(config)
        await gateway.start()
        try:
            async with TestClient(TestServer(build_app(gateway))) as client:
                while not gateway.ready()[0]:
                    await asyncio.sleep(0.01)
                streams = [asyncio.ensure_future(stream_completion(client, f"request number {i}")) for i in range(6)]
                while not first_servicer.in_flight:  # streaming on the only worker there is
                    await asyncio.sleep(0.005)
                added = await client.post("/workers", headers=ADMIN,
                                          json={"url": f"grpc://127.0.0.1:{second_port}", "role": "unified"})
                removal = await client.delete("/workers", headers=ADMIN,
                                              json={"url": f"127.0.0.1:{first_port}", "timeout_s": 60})
                answer = await removal.json()
                streams_done_at_answer = all(s.done() for s in streams)
                results = await asyncio.gather(*streams)
                after = await stream_completion(client, "after the removal")
                return (added.status, await added.json(), answer, streams_done_at_answer, results, after,
                        [w.endpoint.port for w in gateway.registry.workers.values()])
        finally:
            await gateway.stop()
            await first.drain(0.0)
            await second.drain(0.0)

    added_status, added, answer, drained_first, results, after, ports = asyncio.run(run())
    assert added_status == 201 and added["healthy"]
    assert answer["success"] and answer["cut_off_requests"] == 0 and answer["drained_requests"] >= 1, answer
    assert drained_first  # the removal answered once the streams on the worker had ended
    assert results == [{"done": True, "finish": "length", "tokens": MAX_TOKENS}] * 6
    assert after == {"done": True, "finish": "length", "tokens": MAX_TOKENS} and len(ports) == 1
