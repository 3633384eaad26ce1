"""`tandem bench serve` end to end against a small OpenAI-compatible SSE server with known timings."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading

import pytest
from aiohttp import web

from tandem.common.bench import serve

FIRST_CHUNK_DELAY_S = 0.2
CHUNK_GAP_S = 0.02
NUM_CHUNKS = 6
HIT_TOKENS_PER_REQUEST, QUERY_TOKENS_PER_REQUEST = 30, 100


class FakeServer:
    """Streams NUM_CHUNKS one-token chunks: the first after FIRST_CHUNK_DELAY_S, then every CHUNK_GAP_S."""

    def __init__(self, report_usage: bool = True, fail_every: int = 0):
        self.report_usage, self.fail_every = report_usage, fail_every
        self.bodies: list[dict] = []
        self.hit_tokens = self.query_tokens = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner: web.AppRunner | None = None
        self.port = 0

    def __enter__(self) -> FakeServer:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=f"tandem_prefix_cache_hit_tokens_total {self.hit_tokens}\n"
                                 f"tandem_prefix_cache_query_tokens_total {self.query_tokens}\n")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.fail_every and len(self.bodies) % self.fail_every == 0:
            return web.Response(status=503, text="overloaded")
        self.hit_tokens += HIT_TOKENS_PER_REQUEST
        self.query_tokens += QUERY_TOKENS_PER_REQUEST
        chat = "messages" in body
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(FIRST_CHUNK_DELAY_S)
        for i in range(NUM_CHUNKS):
            if i:
                await asyncio.sleep(CHUNK_GAP_S)
            choice = {"index": 0, "delta": {"content": f" t{i}"}} if chat else {"index": 0, "text": f" t{i}"}
            await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        if self.report_usage:
            usage = {"prompt_tokens": 42, "completion_tokens": NUM_CHUNKS, "total_tokens": 42 + NUM_CHUNKS}
            await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    return parser.parse_args(["serve", "--no-progress", *argv])


@pytest.mark.e2e
def test_reports_counts_ttft_and_writes_json_and_plots(tmp_path):
    out_json, plot_dir = tmp_path / "result.json", tmp_path / "plots"
    with FakeServer() as server:
        args = bench_args("--base-url", server.base_url, "--num-prompts", "8", "--random-input-len", "16",
                          "--random-output-len", "6", "--warmup-requests", "2", "--max-concurrency", "4",
                          "--slo-ttft-ms", "5000", "--slo-itl-ms", "1000",
                          "--output-json", str(out_json), "--plot-dir", str(plot_dir))
        assert args.func(args) == 0
    assert len(server.bodies) == 10  # 2 warm-up + 8 timed
    body = server.bodies[-1]
    assert body["model"] == "fake-model" and body["stream"] is True and body["ignore_eos"] is True
    assert body["max_tokens"] == 6 and body["stream_options"] == {"include_usage": True}
    assert len(body["prompt"].split()) == 16

    doc = json.loads(out_json.read_text())
    assert doc["config"]["model"] == "fake-model" and doc["config"]["request_rates"] == ["inf"]
    (run,) = doc["runs"]
    summary, records = run["summary"], run["requests"]
    assert summary["completed"] == 8 and summary["failed"] == 0 and len(records) == 8
    assert summary["total_output_tokens"] == 8 * NUM_CHUNKS
    assert summary["total_input_tokens"] == 8 * 42  # the server's usage count wins over the estimate
    assert all(r["output_tokens"] == NUM_CHUNKS and r["usage_reported"] for r in records)
    assert all(len(r["itl"]) == NUM_CHUNKS - 1 for r in records)
    assert FIRST_CHUNK_DELAY_S * 0.9 <= summary["ttft_ms"]["p50"] / 1e3 <= FIRST_CHUNK_DELAY_S + 1.0
    assert CHUNK_GAP_S * 0.5 <= summary["itl_ms"]["mean"] / 1e3 <= CHUNK_GAP_S + 0.5
    assert summary["good_requests"] == 8
    assert summary["cache_hit_rate"] == pytest.approx(HIT_TOKENS_PER_REQUEST / QUERY_TOKENS_PER_REQUEST)
    for name in ("ttft_cdf", "itl_cdf", "e2e_cdf"):
        assert (plot_dir / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chat_sweep_without_usage_counts_chunks_and_plots_sweep(tmp_path, capsys):
    out_json, plot_dir = tmp_path / "sweep.json", tmp_path / "plots"
    with FakeServer(report_usage=False) as server:
        args = bench_args("--base-url", server.base_url + "/v1", "--endpoint", "chat", "--model", "m",
                          "--dataset", "shared-prefix", "--num-groups", "2", "--prefix-len", "20",
                          "--suffix-len", "4", "--output-len", "6", "--num-prompts", "4",
                          "--request-rate", "inf,40", "--warmup-requests", "0",
                          "--output-json", str(out_json), "--plot-dir", str(plot_dir))
        assert args.func(args) == 0
    assert server.bodies[0]["messages"][0]["role"] == "system"
    doc = json.loads(out_json.read_text())
    assert [run["request_rate"] for run in doc["runs"]] == ["inf", 40.0]
    for run in doc["runs"]:
        assert run["summary"]["completed"] == 4
        assert all(r["output_tokens"] == NUM_CHUNKS and not r["usage_reported"] for r in run["requests"])
    for name in ("throughput_vs_rate", "p99_latency_vs_rate"):
        assert (plot_dir / f"{name}.png").stat().st_size > 0
    assert "Serving benchmark" in capsys.readouterr().out


@pytest.mark.e2e
def test_multi_turn_chat_sends_each_turn_with_its_history_after_the_previous_turn(tmp_path):
    with FakeServer() as server:
        args = bench_args("--base-url", server.base_url, "--endpoint", "chat", "--model", "m",
                          "--dataset", "multi-turn", "--num-conversations", "2", "--num-turns", "3",
                          "--turn-len", "5", "--reply-len", "3", "--output-len", "4", "--num-prompts", "5",
                          "--max-concurrency", "2", "--warmup-requests", "0")
        assert args.func(args) == 0
    assert len(server.bodies) == 5  # --num-prompts caps the 6 turns
    roles = [[m["role"] for m in body["messages"]] for body in server.bodies]
    # Turn-major with at most one turn per conversation in flight: each turn reaches the server after the last.
    assert roles == [["user"], ["user"], ["user", "assistant", "user"], ["user", "assistant", "user"],
                     ["user", "assistant", "user", "assistant", "user"]]
    last = server.bodies[4]["messages"]  # conversation 0's third turn: its second turn, a reply, a new turn
    assert last[:3] in ([b["messages"] for b in server.bodies[2:4]])
    assert all(body["max_tokens"] == 4 for body in server.bodies)


def test_failures_are_counted_with_their_error(tmp_path):
    out_json = tmp_path / "fail.json"
    with FakeServer(fail_every=3) as server:
        args = bench_args("--base-url", server.base_url, "--model", "m", "--num-prompts", "6",
                          "--random-input-len", "8", "--random-output-len", "4", "--warmup-requests", "0",
                          "--max-concurrency", "1", "--output-json", str(out_json))
        assert args.func(args) == 0
    summary = json.loads(out_json.read_text())["runs"][0]["summary"]
    assert summary["completed"] == 4 and summary["failed"] == 2
    assert summary["errors"] == {"HTTP 503: overloaded": 2}
    assert summary["cache_hit_rate"] == pytest.approx(0.3)


def test_config_rejects_bad_flags():
    with pytest.raises(ValueError, match="request-rate"):
        serve.ServeBenchConfig.from_args(bench_args("--base-url", "http://x", "--request-rate", "0"))
    with pytest.raises(ValueError, match="base-url"):
        serve.ServeBenchConfig.from_args(bench_args("--base-url", "localhost:8000"))
    with pytest.raises(ValueError, match="dataset-path"):
        serve.ServeBenchConfig.from_args(bench_args("--base-url", "http://x", "--dataset", "sharegpt"))
    with pytest.raises(ValueError, match="max-concurrency"):
        serve.ServeBenchConfig.from_args(bench_args("--base-url", "http://x", "--dataset", "multi-turn",
                                                    "--num-conversations", "4", "--max-concurrency", "5"))
