"""Request migration between two unified workers (real processes): every stream on a SIGKILLed worker goes on
at the other exactly — greedy streams, a seeded n=2 request, one n=2 request with logprobs and a stop string,
one request on the router's gRPC API — and with --max-migrations 0 a killed worker's stream ends with an error event as before."""

from __future__ import annotations

import asyncio
import re

import aiohttp
import grpc
import pytest

from tandem.common.bench.chaos import leaked
from tandem.common.launcher.children import free_port
from tandem.common.proto_gen.tandem import router_pb2 as rpb
from tandem.common.proto_gen.tandem import router_pb2_grpc as rpb_grpc
from tests.services.migration_helpers import (Streamed, complete, freeze, metric, migrations, prompts,
                                              router_metrics, stream_completion, thaw, wait_for)
from tests.services.router.conftest import RouterProcess, readiness, start_worker, wait_until

pytestmark = pytest.mark.e2e

MAX_TOKENS = 48
GREEDY = {"model": "tiny", "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}


def port_of(worker) -> int:
    return int(re.search(r":(\d+)", worker.ready.group(0)).group(1))


def healthy(router, port: int) -> bool:
    return metric(router_metrics(router.url), "tandem_router_worker_healthy", worker=f"127.0.0.1:{port}") == 1


def stop_at(text: str) -> str:
    """A stop string whose first match is late in `text` (after the kill), so the stop is found after it."""
    for start in range(int(len(text) * 0.7), len(text) - 3):
        candidate = text[start:start + 3]
        if candidate.strip() and text.find(candidate) == start:
            return candidate
    pytest.fail(f"no late stop string in {text!r}")


async def grpc_stream(port: int, prompt: list[int], out: Streamed) -> Streamed:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = rpb.GenerateRequest(model="tiny", token_ids=rpb.TokenIds(ids=prompt), sampling_params=rpb.SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
        async for message in rpb_grpc.RouterStub(channel).Generate(request, timeout=120):
            if message.HasField("usage"):
                out.usage = {"completion_tokens": message.usage.completion_tokens}
                continue
            out.text[0] = out.text.get(0, "") + message.chunk.text
            out.chunks[0] = out.chunks.get(0, 0) + bool(message.chunk.text)
            if message.chunk.finish_reason:
                out.finish[0] = message.chunk.finish_reason
    return out


def test_streams_on_a_killed_worker_continue_exactly_on_the_other(tiny_llama):
    first = start_worker(tiny_llama, free_port())
    second_port = free_port()  # started once the streams run on the first: every stream is on the first
    router = RouterProcess("--worker", f"grpc://127.0.0.1:{port_of(first)}", "--worker", f"grpc://127.0.0.1:{second_port}",
                           "--policy", "round_robin", "--health-check-timeout-s", "120", "--model-path", tiny_llama,
                           "--served-model-name", "tiny")
    second = None
    try:
        wait_until(lambda: readiness(router) == 200, 60, "router readiness")
        second = asyncio.run(_kill_under_streams(router, first, tiny_llama, second_port))
        assert leaked(second_port) == {"requests": 0, "kv_tokens": 0}
    finally:
        assert router.stop() == 0, "".join(router.log[-40:])
        first.kill()
        if second is not None:
            second.stop()


async def _kill_under_streams(router, first, model: str, second_port: int):
    greedy = [{**GREEDY, "prompt": p} for p in prompts(5)]
    seeded_prompt, special_prompt, grpc_prompt = prompts(8)[5:]
    # n=2 seeded: each sequence continues as a request of its own with seed + i, drawing what it would have.
    greedy.append({**GREEDY, "prompt": seeded_prompt, "n": 2, "temperature": 1.0, "seed": 5})
    special = {**GREEDY, "prompt": special_prompt, "n": 2, "logprobs": 2}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
        unfaulted = await complete(session, router.url, special)
        special["stop"] = [stop_at(unfaulted["choices"][0]["text"])]
        reference = await asyncio.gather(*(complete(session, router.url, b) for b in [*greedy, special]),
                                         complete(session, router.url, {**GREEDY, "prompt": grpc_prompt}))
        outs = [Streamed() for _ in range(len(greedy) + 2)]
        tasks = [asyncio.create_task(stream_completion(session, router.url, b, o))
                 for b, o in zip([*greedy, special], outs)]
        tasks.append(asyncio.create_task(grpc_stream(router.grpc_port, grpc_prompt, outs[-1])))
        await wait_for(lambda: all(o.least_chunks(2 if o in outs[-3:-1] else 1) >= 2 for o in outs), 60,
                       "2 tokens on every stream")
        freeze(first.proc)  # no stream ends while the other worker starts
        second = start_worker(model, second_port)
        await wait_for(lambda: healthy(router, second_port), 60, "the second worker healthy")
        first.kill()
        await asyncio.gather(*tasks)
    assert migrations(router.url, "unavailable") == len(outs)  # each request moved once (n=2 as one)
    for ref, out in zip(reference, outs):
        assert out.error is None, out.error
        for choice in ref["choices"]:
            i = choice["index"]
            assert out.text[i] == choice["text"], i
            assert out.finish[i] == choice["finish_reason"]
        assert out.usage["completion_tokens"] == ref["usage"]["completion_tokens"]
    assert outs[-2].finish == {0: "stop", 1: "stop"}
    ref_logprobs = reference[len(greedy)]["choices"]
    for i in (0, 1):
        got, want = outs[-2].logprobs[i], ref_logprobs[i]["logprobs"]
        assert [t for t, _, _ in got] == want["tokens"]
        assert [lp for _, lp, _ in got] == pytest.approx(want["token_logprobs"], abs=1e-3)
        assert [sorted(top) for _, _, top in got] == [sorted(top) for top in want["top_logprobs"]]
    return second


def two_workers_behind_a_router(tiny_llama, *flags: str):
    """Two unified workers and a round-robin router over them (with `flags`), once the router is ready."""
    workers = [start_worker(tiny_llama, free_port()) for _ in range(2)]
    router = RouterProcess(*(a for w in workers for a in ("--worker", f"grpc://127.0.0.1:{port_of(w)}")), *flags,
                           "--policy", "round_robin", "--model-path", tiny_llama, "--served-model-name", "tiny")
    try:
        wait_until(lambda: readiness(router) == 200, 60, "router readiness")
    except BaseException:
        router.stop()
        for w in workers:
            w.kill()
        raise
    return workers, router


def test_max_migrations_0_ends_a_killed_worker_s_stream_with_an_error_event(tiny_llama):
    workers, router = two_workers_behind_a_router(tiny_llama, "--max-migrations", "0")
    try:
        out = asyncio.run(_kill_one(router, workers))
        assert out.error is not None and "failed" in out.error and 0 not in out.finish
        assert migrations(router.url) == 0
    finally:
        assert router.stop() == 0, "".join(router.log[-40:])
        for w in workers:
            w.kill()


async def _kill_one(router, workers) -> Streamed:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        out = Streamed()
        task = asyncio.create_task(stream_completion(session, router.url, {**GREEDY, "prompt": prompts(1)[0]}, out))
        await wait_for(lambda: out.least_chunks(1) >= 2, 60, "2 tokens")
        for w in workers:
            freeze(w.proc)
        victim = max(workers, key=lambda w: metric(router_metrics(router.url), "tandem_router_worker_in_flight_requests",
                                                   worker=f"127.0.0.1:{port_of(w)}"))
        victim.kill()
        for w in workers:
            if w is not victim:
                thaw(w.proc)
        return await task


def test_a_worker_that_stops_answering_health_checks_loses_its_streams_to_the_other(tiny_llama):
    """SIGSTOP, not SIGKILL: the stream stays open, the router's health check fails it (reason health); once the
    worker runs again the router's abort has freed what it held."""
    workers, router = two_workers_behind_a_router(tiny_llama, "--health-check-timeout-s", "1")
    try:
        reference, out, victim = asyncio.run(_freeze_one(router, workers))
        assert out.error is None, out.error
        assert out.text[0] == reference["choices"][0]["text"]
        assert out.usage["completion_tokens"] == MAX_TOKENS
        assert migrations(router.url, "health") == 1
        thaw(victim.proc)
        for w in workers:
            assert leaked(port_of(w)) == {"requests": 0, "kv_tokens": 0}
    finally:
        assert router.stop() == 0, "".join(router.log[-40:])
        for w in workers:
            thaw(w.proc)
            w.kill()


async def _freeze_one(router, workers):
    body = {**GREEDY, "prompt": prompts(1)[0]}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        reference = await complete(session, router.url, body)
        out = Streamed()
        task = asyncio.create_task(stream_completion(session, router.url, body, out))
        await wait_for(lambda: out.least_chunks(1) >= 2, 60, "2 tokens")
        for w in workers:
            freeze(w.proc)
        victim = max(workers, key=lambda w: metric(router_metrics(router.url), "tandem_router_worker_in_flight_requests",
                                                   worker=f"127.0.0.1:{port_of(w)}"))
        for w in workers:
            if w is not victim:
                thaw(w.proc)
        return reference, await task, victim
