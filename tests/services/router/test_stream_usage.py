"""vLLM's stream_options.continuous_usage_stats in process (HTTP and gRPC over a worker on the tiny model): requests
shaped as guidellm 0.8.1 sends them get `usage` on every chunk, growing by the tokens each carries, per choice;
the final usage chunk stays the sum."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer

from tandem.common.proto_gen.tandem import router_pb2 as rpb
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tandem.services.router.http_api import build_app
from tests.services.router.in_process import engine_config, router_stack, threads_settle

PROMPT = "The little cat sat on the"
MAX_TOKENS = 10
BOTH = {"include_usage": True, "continuous_usage_stats": True}
GUIDELLM_HEADERS = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    from tandem.common.engine import Engine

    with Engine(engine_config(tiny_llama)) as engine:
        params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        engine.generate([GenerateRequest("warm", [5, 6, 7], params)])  # starts the model thread
        yield engine


@pytest.fixture(autouse=True)
def no_leaked_threads(request):
    if "engine" in request.fixturenames:
        request.getfixturevalue("engine")
    before = set(threading.enumerate())
    yield
    assert threads_settle(before) == []


def serve(engine, model_dir: str, scenario):
    """scenario(base url, gRPC stub) against a router in front of the engine's worker."""
    async def main():
        async with router_stack(engine, model_dir) as stack:
            server = TestServer(build_app(stack.gateway))
            await server.start_server()
            try:
                return await scenario(str(server.make_url("")).rstrip("/"), stack.stub)
            finally:
                await server.close()
    return asyncio.run(main())


async def sse(url: str, body: dict) -> list[tuple[float, dict]]:
    """(arrival time, event) of each `data:` event up to [DONE], read off the wire as a benchmark client does."""
    events = []
    async with aiohttp.ClientSession() as session:
        async with session.post(url, data=json.dumps(body), headers=GUIDELLM_HEADERS) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    return events
                events.append((time.perf_counter(), json.loads(line[6:])))
    raise AssertionError("the stream ended without [DONE]")


def check_continuous(chunks: list[dict], n: int) -> dict:
    """Every chunk but the last carries choices and usage: prompt tokens fixed, the choice's completion tokens
    growing with each chunk that carries output; the last is the usage chunk, the sum over the choices."""
    *deltas, final = chunks
    assert final["choices"] == [] and final["usage"]["total_tokens"] == (
        final["usage"]["prompt_tokens"] + final["usage"]["completion_tokens"])
    so_far = {i: 0 for i in range(n)}
    for chunk in deltas:
        [choice] = chunk["choices"]
        usage = chunk["usage"]
        assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens"}
        assert usage["prompt_tokens"] == final["usage"]["prompt_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        grew = usage["completion_tokens"] - so_far[choice["index"]]
        carries = choice.get("text") or (choice.get("delta") or {}).get("content")
        role_only = (choice.get("delta") or {}).get("role") == "assistant"
        assert grew == 0 if role_only else grew >= 1 or not carries, (chunk, so_far)
        so_far[choice["index"]] = usage["completion_tokens"]
    assert sum(so_far.values()) == final["usage"]["completion_tokens"] == n * MAX_TOKENS
    return so_far


def guidellm_body(endpoint: str, **extra) -> dict:
    body = {"model": "tiny", "stream": True, "stream_options": BOTH, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    if endpoint == "chat":
        body.update(messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
                    max_completion_tokens=MAX_TOKENS)
    else:
        body["prompt"] = PROMPT
    return {**body, **extra}


@pytest.mark.parametrize("endpoint,path", [("completions", "/v1/completions"), ("chat", "/v1/chat/completions")])
def test_guidellm_requests_get_usage_on_every_chunk(engine, tiny_llama, endpoint, path):
    async def scenario(base, _):
        timed = await sse(base + path, guidellm_body(endpoint, temperature=0))
        plain = await sse(base + path, guidellm_body(endpoint, temperature=0, stream_options={"include_usage": True}))
        return timed, plain

    timed, plain = serve(engine, tiny_llama, scenario)
    chunks = [event for _, event in timed]
    check_continuous(chunks, 1)
    *deltas, final = chunks
    assert deltas[-1]["usage"]["completion_tokens"] == final["usage"]["completion_tokens"]
    if endpoint == "chat":  # the role chunk: no output yet
        assert deltas[0]["choices"][0]["delta"]["role"] == "assistant"
        assert deltas[0]["usage"]["completion_tokens"] == 0
    output = [t for t, event in timed[:-1] if (event["choices"][0].get("text")
                                                or event["choices"][0].get("delta", {}).get("content"))]
    assert len(output) >= 2 and output[0] < output[-1]  # TTFT and inter-token latency are measurable
    assert all(event["usage"] is None for _, event in plain[:-1])  # include_usage alone: as before
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: the second run hits the cache
    assert [plain[-1][1]["usage"][k] for k in counts] == [final["usage"][k] for k in counts]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_n_choices_count_their_own_tokens(engine, tiny_llama, endpoint):
    async def scenario(base, _):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        try:
            if endpoint == "chat":
                stream = await client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": PROMPT}], max_completion_tokens=MAX_TOKENS,
                    n=2, seed=3, stream=True, stream_options=BOTH, extra_body={"ignore_eos": True})
            else:
                stream = await client.completions.create(
                    model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, n=2, seed=3, stream=True, stream_options=BOTH,
                    extra_body={"ignore_eos": True})
            return [chunk.model_dump(exclude_unset=True) async for chunk in stream]  # as sent
        finally:
            await client.close()

    chunks = serve(engine, tiny_llama, scenario)
    so_far = check_continuous(chunks, 2)
    assert so_far == {0: MAX_TOKENS, 1: MAX_TOKENS}  # each choice's own count, not the running sum


def test_each_prompt_of_a_completions_batch_reports_its_own_prompt_tokens(engine, tiny_llama):
    prompts = [PROMPT, "Once upon a time there was a"]

    async def scenario(base, _):
        return [event for _, event in await sse(base + "/v1/completions", guidellm_body("completions", prompt=prompts))]

    chunks = serve(engine, tiny_llama, scenario)
    *deltas, final = chunks
    prompt_tokens = {c["choices"][0]["index"]: c["usage"]["prompt_tokens"] for c in deltas}
    assert len(set(prompt_tokens.values())) == 2 and sum(prompt_tokens.values()) == final["usage"]["prompt_tokens"]
    last = {c["choices"][0]["index"]: c["usage"]["completion_tokens"] for c in deltas}
    assert last == {0: MAX_TOKENS, 1: MAX_TOKENS} and final["usage"]["completion_tokens"] == 2 * MAX_TOKENS


def test_continuous_usage_stats_alone_changes_nothing(engine, tiny_llama):
    async def scenario(base, _):
        return await sse(base + "/v1/completions", guidellm_body("completions", stream_options={
            "continuous_usage_stats": True}))

    events = [event for _, event in serve(engine, tiny_llama, scenario)]
    assert events and all("usage" not in e and e["choices"] for e in events)  # no usage anywhere, as vLLM


@pytest.mark.parametrize("method", ["Generate", "Chat"])
def test_grpc_chunks_carry_usage_when_asked(engine, tiny_llama, method):
    params = rpb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, n=2, seed=3)

    def request(continuous: bool):
        if method == "Chat":
            return rpb.ChatRequest(messages=[rpb.ChatMessage(role="user", content=PROMPT)], sampling_params=params,
                                   continuous_usage_stats=continuous)
        return rpb.GenerateRequest(text=PROMPT, sampling_params=params, continuous_usage_stats=continuous)

    async def scenario(_, stub):
        call = getattr(stub, method)
        return [r async for r in call(request(True))], [r async for r in call(request(False))]

    timed, plain = serve(engine, tiny_llama, scenario)
    *chunks, final = timed
    so_far = {0: 0, 1: 0}
    for response in chunks:
        chunk = response.chunk
        assert chunk.usage.prompt_tokens == final.usage.prompt_tokens > 0
        assert chunk.usage.completion_tokens == so_far[chunk.index] + len(chunk.token_ids)  # exactly what it carries
        so_far[chunk.index] = chunk.usage.completion_tokens
    assert so_far == {0: MAX_TOKENS, 1: MAX_TOKENS} and final.usage.completion_tokens == 2 * MAX_TOKENS
    assert all(not r.chunk.HasField("usage") for r in plain[:-1]) and plain[-1].HasField("usage")
