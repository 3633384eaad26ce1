"""Overload on a PD pair and on a unified worker: a burst needing far more KV than the pool holds never ends in
a 504. The router admits only what some worker has KV room for, queues a bounded number and answers the rest 429
with Retry-After; with router admission off, the decode's prealloc queue absorbs it instead of the prefill's
bootstrap timeout firing (that timeout counts from when pages could be reserved)."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
import pytest

from tandem.common.bench.chaos import PROMPT, leaked, one_request
from tandem.common.bench.local_stack import WORKER_LISTENING, LocalProcesses

pytestmark = pytest.mark.e2e

# A 1,024-token decode pool for 24 requests of ~245 tokens each (four at a time), and a 2 s bootstrap timeout: most
# legs wait in the prealloc queue several times longer than 2 s (before the bootstrap-wait fix, 29 of a burst of 96
# such requests ended in HTTP 504).
WORKER_FLAGS = ("--max-total-tokens", "1024", "--bootstrap-timeout", "2", "--transfer-timeout", "20")
QUEUEING_BURST, QUEUEING_TOKENS = 24, 200


async def burst(base: str, model: str, n: int, max_tokens: int) -> dict:
    # A patient client (the router allows 120 s): on a loaded CI machine the last of a burst may wait long.
    async with aiohttp.ClientSession() as session:
        outcomes = await asyncio.gather(*(one_request(session, base, model, max_tokens, timeout_s=150)
                                          for _ in range(n)))
    return {o: outcomes.count(o) for o in set(outcomes)}


def test_a_burst_beyond_the_decode_pool_queues_instead_of_timing_out(tiny_llama, tmp_path):
    with LocalProcesses(tmp_path) as procs:
        pd = procs.wait_pd(procs.start_pd(tiny_llama, "overload", prefill_extra=WORKER_FLAGS,
                                          decode_extra=WORKER_FLAGS))
        base = procs.wait_router(procs.start_router(tiny_llama, "overload", pd,
                                                    extra=("--request-timeout-s", "120", "--no-kv-admission")))
        with urllib.request.urlopen(base + "/v1/models", timeout=10) as resp:
            model = json.load(resp)["data"][0]["id"]
        assert asyncio.run(burst(base, model, QUEUEING_BURST, QUEUEING_TOKENS)) == {"ok": QUEUEING_BURST}
        for port in pd.grpc_ports:
            assert leaked(port) == {"requests": 0, "kv_tokens": 0}


# A 1,024-token pool; each request reserves its prompt (~45 tokens) + 200: four fit at once. 40 arrive together,
# 8 may wait in the router's queue for up to 3 s.
SMALL_POOL = ("--max-total-tokens", "1024")
ADMISSION_FLAGS = ("--max-queued", "8", "--queue-timeout-s", "3", "--load-poll-interval-s", "0.2")
BURST, MAX_TOKENS = 40, 200


async def admitted_or_refused(session: aiohttp.ClientSession, base: str, model: str) -> tuple[str, str | None]:
    """('ok' | 'http_<status>' | a stream failure, the Retry-After header of a refusal)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    async with session.post(f"{base}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)) as resp:
        payload = await resp.json()
        if resp.status != 200:
            return f"http_{resp.status}", resp.headers.get("Retry-After")
        assert payload["usage"]["completion_tokens"] == MAX_TOKENS
        return "ok", None


def router_samples(base: str) -> dict:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def run_burst_through_admission(base: str, worker_ports: list[int]) -> None:
    with urllib.request.urlopen(base + "/v1/models", timeout=10) as resp:
        model = json.load(resp)["data"][0]["id"]

    async def burst_all() -> list[tuple[str, str | None]]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(admitted_or_refused(session, base, model) for _ in range(BURST)))

    outcomes = asyncio.run(burst_all())
    kinds = [kind for kind, _ in outcomes]
    assert set(kinds) <= {"ok", "http_429"}, kinds  # never a 504, never a failed stream
    assert kinds.count("ok") >= 4 and kinds.count("http_429") >= BURST - 4 - 8 - 8, kinds
    assert all(retry is not None and int(retry) >= 1 for kind, retry in outcomes if kind == "http_429")
    samples = router_samples(base)
    refused = sum(v for (name, _), v in samples.items() if name == "tandem_router_queue_rejections_total")
    assert refused == kinds.count("http_429")
    assert samples[("tandem_router_queued_requests", (("model_name", model),))] == 0
    for port in worker_ports:
        assert leaked(port) == {"requests": 0, "kv_tokens": 0}


def test_router_admission_by_decode_kv_queues_a_burst_and_refuses_the_rest_with_retry_after(tiny_llama, tmp_path):
    with LocalProcesses(tmp_path) as procs:
        pd = procs.wait_pd(procs.start_pd(tiny_llama, "admission", decode_extra=SMALL_POOL))
        base = procs.wait_router(procs.start_router(tiny_llama, "admission", pd, extra=ADMISSION_FLAGS))
        run_burst_through_admission(base, [pd.prefill[0][0], pd.decode])


def test_router_admission_by_unified_worker_kv(tiny_llama, tmp_path):
    with LocalProcesses(tmp_path) as procs:
        worker = procs.worker("admission-worker", "worker", tiny_llama, 1, "1", SMALL_POOL)
        port = procs.port(worker, WORKER_LISTENING)
        base = procs.wait_router(procs.start_router(tiny_llama, "admission", worker=port, extra=ADMISSION_FLAGS))
        run_burst_through_admission(base, [port])


# The estimate: 4,096-token decode pool; 120 completions of ~400 prompt tokens with max_tokens 1,200 (the router's
# full reservation, ~1,570 each, fits two at a time) that stop after a few tokens (a stop string taken from each
# prompt's greedy output). With the default --admission-reserve estimate the router learns they use little
# and admits more at once; all must be served within the queue timeout.
ESTIMATE_POOL = ("--max-total-tokens", "4096")
ESTIMATE_ROUTER = ("--queue-timeout-s", "120", "--request-timeout-s", "300", "--load-poll-interval-s", "0.2")
LONG_PROMPTS = [f"Turn {v}. " + PROMPT * 3 for v in range(4)]  # ~370 tokens each
SHORT_TURN_MAX_TOKENS = 1200


async def complete(session: aiohttp.ClientSession, base: str, body: dict) -> tuple[str, dict]:
    """('ok' | 'http_<status>' | 'timeout', the JSON answer)."""
    try:
        async with session.post(f"{base}/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=280)) as resp:
            payload = await resp.json(content_type=None)
            return ("ok" if resp.status == 200 else f"http_{resp.status}"), payload
    except asyncio.TimeoutError:
        return "timeout", {}


async def stop_strings(session: aiohttp.ClientSession, base: str, model: str) -> list[str]:
    """Each prompt's greedy continuation (8 tokens), cut to a stop string that ends it early."""
    stops = []
    for prompt in LONG_PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        outcome, payload = await complete(session, base, body)
        assert outcome == "ok", payload
        text = payload["choices"][0]["text"]
        stops.append(text[len(text) // 2:] or text)
    return stops


async def short_turns(base: str, model: str, n: int) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:  # all n at once
        stops = await stop_strings(session, base, model)
        bodies = [{"model": model, "prompt": LONG_PROMPTS[i % 4], "max_tokens": SHORT_TURN_MAX_TOKENS,
                   "temperature": 0.0, "stop": [stops[i % 4]]} for i in range(n)]
        results = await asyncio.gather(*(complete(session, base, body) for body in bodies))
    outcomes = [outcome for outcome, _ in results]
    used = [p["usage"]["completion_tokens"] for outcome, p in results if outcome == "ok"]
    errors = [p for outcome, p in results if outcome != "ok"][:1]
    return {"outcomes": {o: outcomes.count(o) for o in set(outcomes)}, "early": sum(u < 100 for u in used),
            "first_error": errors}


def test_a_burst_of_short_turns_with_a_large_max_tokens_is_served_whole(tiny_llama, tmp_path):
    with LocalProcesses(tmp_path) as procs:
        pd = procs.wait_pd(procs.start_pd(tiny_llama, "estimate", decode_extra=ESTIMATE_POOL))
        base = procs.wait_router(procs.start_router(tiny_llama, "estimate", pd, extra=ESTIMATE_ROUTER))
        with urllib.request.urlopen(base + "/v1/models", timeout=10) as resp:
            model = json.load(resp)["data"][0]["id"]
        result = asyncio.run(short_turns(base, model, 120))
        assert result["outcomes"] == {"ok": 120}, result  # no 429, no 5xx
        assert result["early"] >= 60, result  # most did stop early: the estimate had something to learn
        for port in [pd.prefill[0][0], pd.decode]:
            assert leaked(port) == {"requests": 0, "kv_tokens": 0}


async def worst_case(base: str, model: str) -> tuple[dict, dict]:
    """Short turns teach the router a low ratio; then a wave that really runs to max_tokens."""
    learned = await short_turns(base, model, 30)
    body = {"model": model, "prompt": LONG_PROMPTS[0], "max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(complete(session, base, body) for _ in range(24)))
    for outcome, payload in results:
        assert outcome != "ok" or payload["usage"]["completion_tokens"] == 400
    outcomes = [outcome for outcome, _ in results]
    return learned, {o: outcomes.count(o) for o in set(outcomes)}


@pytest.mark.timeout(500)
def test_a_wave_that_outruns_the_estimate_completes_or_is_refused_cleanly_and_leaks_nothing(tiny_llama, tmp_path):
    """24 x (400 + 400) tokens on a 4,096-token pool after the ratio fell: the decode waits or retracts; every
    request ends 200 (all 400 tokens) or 429, and both workers end empty."""
    with LocalProcesses(tmp_path) as procs:
        pd = procs.wait_pd(procs.start_pd(tiny_llama, "worst", decode_extra=ESTIMATE_POOL))
        base = procs.wait_router(procs.start_router(tiny_llama, "worst", pd, extra=ESTIMATE_ROUTER))
        with urllib.request.urlopen(base + "/v1/models", timeout=10) as resp:
            model = json.load(resp)["data"][0]["id"]
        learned, outcomes = asyncio.run(worst_case(base, model))
        assert learned["outcomes"] == {"ok": 30}, learned
        assert set(outcomes) <= {"ok", "http_429"} and outcomes.get("ok", 0) >= 1, outcomes
        for port in [pd.prefill[0][0], pd.decode]:
            assert leaked(port) == {"requests": 0, "kv_tokens": 0}
