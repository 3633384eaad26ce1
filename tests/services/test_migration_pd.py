"""Request migration through a real PD stack (1 prefill + 2 decodes + router): a decode SIGKILLed while 16
streams run on the two; every stream completes with the text of an unfaulted run, usage counts all its tokens,
and the surviving workers hold no request and no KV after."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tandem.common.bench.chaos import leaked
from tests.common.rpc.helpers import WorkerProcess, stop_together
from tests.services.migration_helpers import (Streamed, complete, freeze, in_flight, metric, migrations, prompts,
                                              router_metrics, stream_completion, thaw, wait_for)
from tests.services.pd_helpers import PD_FLAGS
from tests.services.router.conftest import RouterProcess, readiness, wait_until

pytestmark = pytest.mark.e2e

STREAMS = 16
MAX_TOKENS = 48
SCHEMA = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]},
                                           "count": {"type": "integer"}, "note": {"type": "string", "maxLength": 40}},
          "required": ["color", "count", "note"]}


@pytest.fixture(scope="module")
def stack(tiny_llama):
    prefill = WorkerProcess(tiny_llama, "--bootstrap-port", "0", command="prefill", flags=PD_FLAGS, wait=False)
    decodes = [WorkerProcess(tiny_llama, command="decode", flags=PD_FLAGS, wait=False) for _ in range(2)]
    workers = [prefill, *decodes]
    try:
        for w in workers:
            w.wait_ready()
        router = RouterProcess("--prefill", f"grpc://{prefill.address},{prefill.bootstrap_port}",
                               *(a for d in decodes for a in ("--decode", f"grpc://{d.address}")),
                               "--decode-policy", "round_robin", "--model-path", tiny_llama,
                               "--served-model-name", "tiny")
    except BaseException:
        for w in workers:
            w.proc.kill()
        raise
    wait_until(lambda: readiness(router) == 200, 60, "router readiness")
    yield router, prefill, decodes
    router.stop()
    stop_together(w for w in (prefill, *decodes) if w.proc.poll() is None)


def revive(stack, model: str) -> None:
    """A decode an earlier test killed starts again on its port (the router's registry knows it by address)."""
    router, _, decodes = stack
    for i, d in enumerate(decodes):
        if d.proc.poll() is not None:
            decodes[i] = WorkerProcess(model, "--port", str(d.port), command="decode", flags=PD_FLAGS)
            wait_until(lambda: metric(router_metrics(router.url), "tandem_router_worker_healthy",
                                      worker=decodes[i].address) == 1, 60, "the restarted decode healthy")


def bodies(extra: dict) -> list[dict]:
    return [{"model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS, "ignore_eos": True, **extra}
            for p in prompts(STREAMS)]


async def kill_under_streams(router, prefill, decodes, extra: dict) -> tuple[list[dict], list[Streamed], float]:
    """The requests unfaulted, then streamed while the decode holding the most of them is SIGKILLed (both
    decodes frozen once every stream has 2 tokens, so none finishes before the kill)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        reference = await asyncio.gather(*(complete(session, router.url, b) for b in bodies(extra)))
        before = migrations(router.url)
        outs = [Streamed() for _ in range(STREAMS)]
        tasks = [asyncio.create_task(stream_completion(session, router.url, b, o))
                 for b, o in zip(bodies(extra), outs)]
        await wait_for(lambda: all(o.least_chunks(1) >= 2 for o in outs), 60, "2 tokens on every stream")
        for d in decodes:
            freeze(d.proc)
        held = {d: in_flight(router.url, d.address) for d in decodes}
        victim = max(decodes, key=held.get)
        victim.proc.kill()
        victim.proc.wait()
        for d in decodes:
            if d is not victim:
                thaw(d.proc)
        await asyncio.gather(*tasks)
    assert held[victim] >= 1, held
    return reference, outs, migrations(router.url) - before


def check_continued_exactly(reference: list[dict], outs: list[Streamed], migrated: float) -> None:
    assert migrated >= 1  # the frozen victim held streams: they moved
    for ref, out in zip(reference, outs):
        assert out.error is None, out.error
        assert out.text[0] == ref["choices"][0]["text"]
        assert out.finish[0] == ref["choices"][0]["finish_reason"]
        assert out.usage["completion_tokens"] == ref["usage"]["completion_tokens"]
        assert out.usage["prompt_tokens"] == ref["usage"]["prompt_tokens"]


def survivors_hold_nothing(prefill, decodes) -> None:
    for w in (prefill, *decodes):
        if w.proc.poll() is None:
            assert leaked(w.port) == {"requests": 0, "kv_tokens": 0}, w.address


def test_greedy_streams_survive_a_decode_sigkill(stack, tiny_llama):
    revive(stack, tiny_llama)
    router, prefill, decodes = stack
    reference, outs, migrated = asyncio.run(kill_under_streams(router, prefill, decodes, {"temperature": 0}))
    check_continued_exactly(reference, outs, migrated)
    assert all(o.usage["completion_tokens"] == MAX_TOKENS for o in outs)
    survivors_hold_nothing(prefill, decodes)


@pytest.mark.parametrize("extra", [
    pytest.param({"temperature": 1.0, "top_p": 0.9, "seed": 1234}, id="seeded"),
    pytest.param({"temperature": 0.7, "seed": 7, "ignore_eos": False,
                  "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}},
                 id="json_schema"),
])
def test_seeded_and_constrained_streams_survive_a_decode_sigkill(stack, tiny_llama, extra):
    revive(stack, tiny_llama)
    router, prefill, decodes = stack
    reference, outs, migrated = asyncio.run(kill_under_streams(router, prefill, decodes, extra))
    check_continued_exactly(reference, outs, migrated)
    if "response_format" in extra:  # constrained all along (a random model may run out of tokens first)
        for out in outs:
            assert out.text[0].lstrip().startswith("{")
            if out.finish[0] == "stop":
                assert set(json.loads(out.text[0])) == {"color", "count", "note"}
    survivors_hold_nothing(prefill, decodes)
