"""Streams through a router while a worker is killed under them: an SSE client that records what each stream
received, and the router's /metrics read for migrations and per-worker in-flight counts."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Optional

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Streamed:
    """What one streamed completion delivered, per choice."""

    text: dict[int, str] = field(default_factory=dict)
    chunks: dict[int, int] = field(default_factory=dict)  # chunks with output text (each holds >= 1 token)
    finish: dict[int, str] = field(default_factory=dict)
    logprobs: dict[int, list] = field(default_factory=dict)  # (token, logprob, top) per output token
    usage: Optional[dict] = None
    error: Optional[str] = None

    def least_chunks(self, n: int) -> int:
        return min(self.chunks.get(i, 0) for i in range(n))


async def stream_completion(session: aiohttp.ClientSession, url: str, body: dict, out: Streamed) -> Streamed:
    """POST a streamed /v1/completions; `out` fills in as chunks arrive (others watch it meanwhile)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                out.error = event["error"]["message"]
                continue
            if event.get("usage"):
                out.usage = event["usage"]
            for choice in event.get("choices", []):
                i = choice["index"]
                out.text[i] = out.text.get(i, "") + choice["text"]
                out.chunks[i] = out.chunks.get(i, 0) + bool(choice["text"])
                if choice.get("finish_reason"):
                    out.finish[i] = choice["finish_reason"]
                lps = choice.get("logprobs")
                if lps:
                    out.logprobs.setdefault(i, []).extend(zip(lps["tokens"], lps["token_logprobs"],
                                                              lps["top_logprobs"] or [None] * len(lps["tokens"])))
    return out


async def complete(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def router_metrics(url: str) -> list:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def metric(samples: list, name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def in_flight(url: str, address: str) -> float:
    return metric(router_metrics(url), "tandem_router_worker_in_flight_requests", worker=address)


def migrations(url: str, reason: Optional[str] = None) -> float:
    labels = {"reason": reason} if reason else {}
    return metric(router_metrics(url), "tandem_router_migrations_total", **labels)


def freeze(proc) -> None:
    os.kill(proc.pid, signal.SIGSTOP)


def thaw(proc) -> None:
    os.kill(proc.pid, signal.SIGCONT)


def prompts(count: int) -> list[list[int]]:
    """Distinct short prompts of token ids (no shared prefix to steer a cache-aware policy)."""
    return [[(17 * i + 7 * j) % 400 + 20 for j in range(6 + i % 5)] for i in range(count)]
