"""SGLang's expert-distribution recorder routes through the router's HTTP API, in process (a worker server over an
in-process Engine): a window recorded around completions on a tiny MoE model counts every forwarded token top_k
times per MoE layer, GET works as POST, the answer is an --init-expert-location file, the worker's /metrics shows
tandem_expert_imbalance; a dense model's worker refuses (400, naming it)."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tandem.common.config import EngineConfig
from tandem.common.model.parallel.experts import load_location
from tandem.common.telemetry.metrics import WorkerMetrics
from tandem.common.telemetry.metrics_server import start_metrics_server
from tandem.services.router.http_api import build_app
from tests.services.router.in_process import MAX_CONTEXT_LEN, router_stack

ADMIN = {"Authorization": "Bearer admin-secret"}
PROMPTS = ["The little cat sat on the mat", "Seven green apples"]
MAX_TOKENS = 5


def make_engine(model_dir: str, metrics: WorkerMetrics):
    from tandem.common.engine import Engine

    # The normal loop forwards exactly prompt + completion - 1 tokens per request (the overlap loop one more).
    return Engine(EngineConfig(model_path=model_dir, max_total_tokens=4096, page_size=4,
                               max_context_len=MAX_CONTEXT_LEN, event_loop="normal"), metrics=metrics)


@pytest.fixture(scope="module")
def moe(model_factory):
    model_dir, metrics = model_factory("qwen3_moe"), WorkerMetrics("unified")
    with make_engine(model_dir, metrics) as engine:
        yield engine, model_dir, metrics


def over_http(engine, model_dir: str, scenario):
    async def main():
        async with router_stack(engine, model_dir, admin_api_key="admin-secret") as stack:
            async with TestClient(TestServer(build_app(stack.gateway))) as client:
                return await scenario(client)
    return asyncio.run(main())


async def call(client, method: str, path: str, headers: dict = ADMIN, json=None) -> tuple[int, dict]:
    resp = await client.request(method, path, headers=headers, json=json)
    return resp.status, await resp.json()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def test_a_recorded_window_counts_each_token_top_k_times_per_moe_layer(moe, tmp_path):
    engine, model_dir, metrics = moe

    async def scenario(client):
        replies = {"start": await call(client, "POST", "/start_expert_distribution_record")}
        forwarded = 0
        for prompt in PROMPTS:
            status, body = await call(client, "POST", "/v1/completions", {}, {
                "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
            assert status == 200, body
            usage = body["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            forwarded += usage["prompt_tokens"] - cached + usage["completion_tokens"] - 1
        replies["stop"] = await call(client, "GET", "/stop_expert_distribution_record")
        await call(client, "POST", "/v1/completions", {}, {"prompt": "not counted", "max_tokens": 2})
        replies["dump"] = await call(client, "GET", "/dump_expert_distribution_record")
        replies["post_dump"] = await call(client, "POST", "/dump_expert_distribution_record", json={})
        replies["no_key"] = await call(client, "GET", "/dump_expert_distribution_record", {})
        return forwarded, replies
    forwarded, replies = over_http(engine, model_dir, scenario)
    for name in ("start", "stop", "dump"):
        status, body = replies[name]
        assert status == 200 and body["success"], (name, body)
        assert [(w["role"], w["success"]) for w in body["workers"]] == [("unified", True)]
    status, body = replies["dump"]
    moe_config = engine.model_config.moe
    assert body["num_steps"] > 0 and len(body["logical_count"]) == len(moe_config.layers)
    for layer in body["logical_count"]:
        assert sum(layer) == forwarded * moe_config.top_k
    worker_dump = body["workers"][0]["dump"]
    assert worker_dump["logical_count"] == body["logical_count"] and not worker_dump["recording"]
    assert replies["post_dump"][1]["logical_count"] == body["logical_count"]  # stopped: the window is kept
    assert replies["no_key"][0] == 401
    # Saved, the router's answer is an --init-expert-location file: EPLB places from the summed counts.
    (tmp_path / "dump.json").write_text(json.dumps(body))
    location = load_location(str(tmp_path / "dump.json"), len(moe_config.layers), moe_config.num_experts,
                             moe_config.num_experts, 1)
    assert location.physical_to_logical.shape == (len(moe_config.layers), moe_config.num_experts)

    server = start_metrics_server(metrics.exposition("tiny"), "127.0.0.1", 0)
    try:
        text = scrape(server.port)
    finally:
        server.close()
    for layer in moe_config.layers:
        assert (f'tandem_expert_imbalance_count{{layer="{layer}",model_name="tiny",role="unified"}} '
                f'{float(body["num_steps"])}') in text


def test_a_dense_model_refuses_naming_it(tiny_llama):
    with make_engine(tiny_llama, WorkerMetrics.off("unified")) as engine:
        async def scenario(client):
            return [await call(client, "POST", f"/{name}_expert_distribution_record")
                    for name in ("start", "stop", "dump")]
        replies = over_http(engine, tiny_llama, scenario)
    for status, body in replies:
        assert status == 400 and not body["success"], body
        [worker] = body["workers"]
        assert not worker["success"] and worker["message"].startswith("FAILED_PRECONDITION: ")
        assert "is a dense model: it has no experts to record" in worker["message"]
        assert "logical_count" not in body
