"""Async aiohttp client for `tandem bench serve`: one streamed OpenAI request, and the load generator."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import numpy as np
import orjson
import uvloop

from tandem.common.bench.metrics import RequestRecord, cache_counters
from tandem.common.bench.workloads import BenchRequest

logger = logging.getLogger(__name__)

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
T = TypeVar("T")


def run_client(main: Coroutine[Any, Any, T]) -> T:
    """Run the load generator on uvloop: it shares the cores with the server it measures on small machines, and
    libuv's loop costs about half of asyncio's CPU per streamed chunk (docs/performance-history.md section 17)."""
    return uvloop.run(main)


@dataclass
class Target:
    """Where requests go and how they are shaped."""

    base_url: str
    endpoint: str
    model: str
    api_key: str | None = None
    ignore_eos: bool = True
    request_timeout_s: float = 600.0

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINT_PATHS[self.endpoint]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def payload(self, req: BenchRequest) -> dict:
        body = {"model": self.model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.endpoint == "chat":
            messages = [{"role": "system", "content": req.system}] if req.system else []
            body["messages"] = messages + list(req.history) + [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.full_prompt()
        return body


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, bytes]]:
    """(arrival time, data) of each `data:` line, as bytes (orjson parses them without a decode); ends at [DONE]
    or when the server closes the stream."""
    buffer = b""
    async for chunk in response.content.iter_any():
        now = time.perf_counter()
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for raw in lines:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            yield now, data


def chunk_text(event: dict, endpoint: str) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        delta = choices[0].get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choices[0].get("text") or ""


async def send_request(session: aiohttp.ClientSession, target: Target, req: BenchRequest,
                       bench_start: float) -> RequestRecord:
    record = RequestRecord(prompt_len=req.prompt_len, output_len=req.output_len)
    start = time.perf_counter()
    record.start = start - bench_start
    chunks, last = 0, start
    try:
        async with session.post(target.url, json=target.payload(req), headers=target.headers()) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return record
            async for now, data in sse_events(resp):
                event = orjson.loads(data)
                if "error" in event:
                    record.error = f"stream error: {str(event['error'])[:200]}"
                    return record
                if usage := event.get("usage"):
                    record.output_tokens = int(usage.get("completion_tokens") or 0)
                    record.prompt_len = int(usage.get("prompt_tokens") or record.prompt_len)
                    record.usage_reported = True
                if chunk_text(event, target.endpoint):
                    if chunks == 0:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last)
                    chunks, last = chunks + 1, now
        record.e2e = time.perf_counter() - start
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, ValueError) as e:
        record.error = f"{type(e).__name__}: {str(e)[:200]}"
        return record
    if chunks == 0:
        record.error = "no content in the stream"
        return record
    if not record.usage_reported:
        record.output_tokens = chunks
    record.success = True
    return record


def open_session(target: Target, max_concurrency: int | None) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=target.request_timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


async def fetch_first_model(base_url: str, api_key: str | None, timeout_s: float = 30.0) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async with session.get(base_url + "/v1/models", headers=headers) as resp:
            if resp.status != 200:
                raise ValueError(f"GET {base_url}/v1/models returned HTTP {resp.status}; pass --model")
            models = (await resp.json()).get("data") or []
    if not models:
        raise ValueError(f"GET {base_url}/v1/models listed no models; pass --model")
    return str(models[0]["id"])


async def fetch_cache_counters(session: aiohttp.ClientSession, base_url: str) -> tuple[float, float] | None:
    """Tandem's prefix-cache counters from /metrics, or None when the server does not expose them."""
    try:
        async with session.get(base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status != 200:
                return None
            return cache_counters(await resp.text())
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


def arrival_gaps(num: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential gaps (Poisson arrivals), all zero when rate is inf."""
    if request_rate == float("inf"):
        return [0.0] * num
    return np.random.default_rng(seed).exponential(1.0 / request_rate, size=num).tolist()


async def run_load(session: aiohttp.ClientSession, target: Target, requests: list[BenchRequest],
                   request_rate: float, max_concurrency: int | None, seed: int,
                   progress=None) -> tuple[list[RequestRecord], float]:
    """Send every request once on the arrival schedule; returns the records (in request order) and the duration."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bench_start = time.perf_counter()

    async def one(req: BenchRequest) -> RequestRecord:
        if semaphore is None:
            record = await send_request(session, target, req, bench_start)
        else:
            async with semaphore:
                record = await send_request(session, target, req, bench_start)
        if progress is not None:
            progress.update(1)
        return record

    tasks = []
    for req, gap in zip(requests, arrival_gaps(len(requests), request_rate, seed)):
        if gap > 0:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(req)))
    records = await asyncio.gather(*tasks)
    return list(records), time.perf_counter() - bench_start
