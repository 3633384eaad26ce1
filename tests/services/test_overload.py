"""Overload on a PD pair: a burst needing far more KV than the decode pool holds waits in the decode's prealloc
queue instead of failing with the prefill's bootstrap timeout (which counts from when pages could be reserved)."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp

from common.bench.chaos import one_request
from common.bench.local_stack import LocalProcesses

# A 1,536-token decode pool for 96 requests of ~300 tokens each, and a 3 s bootstrap timeout: most legs wait in the
# prealloc queue far longer than 3 s (before the fix, 29 of 96 ended in HTTP 504).
WORKER_FLAGS = ("--max-total-tokens", "1536", "--bootstrap-timeout", "3", "--transfer-timeout", "20")


async def burst(base: str, model: str, n: int, max_tokens: int) -> dict:
    async with aiohttp.ClientSession() as session:
        outcomes = await asyncio.gather(*(one_request(session, base, model, max_tokens) for _ in range(n)))
    return {o: outcomes.count(o) for o in set(outcomes)}


def test_a_burst_beyond_the_decode_pool_queues_instead_of_timing_out(tiny_llama, tmp_path):
    with LocalProcesses(tmp_path) as procs:
        pd = procs.wait_pd(procs.start_pd(tiny_llama, "overload", prefill_extra=WORKER_FLAGS,
                                          decode_extra=WORKER_FLAGS))
        base = procs.wait_router(procs.start_router(tiny_llama, "overload", pd, extra=("--request-timeout-s", "120")))
        with urllib.request.urlopen(base + "/v1/models", timeout=10) as resp:
            model = json.load(resp)["data"][0]["id"]
        assert asyncio.run(burst(base, model, 96, 300)) == {"ok": 96}
