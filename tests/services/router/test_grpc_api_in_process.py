"""The router's gRPC API (tandem.router.v1) in process: a real grpc.aio server and Gateway in front of a worker
server over an in-process Engine on the tiny model. Streams equal the engine's greedy output; bad input is
INVALID_ARGUMENT naming the field; a cancelled or expired stream leaves nothing running at the worker."""

from __future__ import annotations

import asyncio
import math
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tokenizers import Tokenizer

from tandem.common.proto_gen.tandem import router_pb2 as rpb
from tandem.common.proto_gen.tandem import router_pb2_grpc as rpb_grpc
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tandem.common.telemetry import tracing
from tandem.services.router import grpc_api
from tandem.services.router.config import RouterConfig, WorkerEndpoint
from tandem.services.router.gateway import Gateway
from tandem.services.router.grpc_api import GrpcApi
from tandem.services.router.messages import ChoiceDelta, LogprobEntry, ToolCallDelta, Usage
from tests.services.router.in_process import MAX_CONTEXT_LEN, engine_config, router_stack, threads_settle

PROMPT = "The little cat sat on the"
HI = [rpb.ChatMessage(role="user", content="hi")]
LONG = rpb.SamplingParams(max_tokens=1000, ignore_eos=True)  # with `slowed`, >= 10 s: outlives 0.25 s deadlines


@pytest.fixture
def slowed(engine):
    """Every forward sleeps 10 ms (the runtime control's slow-down), so a LONG request outlives a short deadline
    on any machine."""
    engine.control.slow_down(0.01)
    yield engine
    engine.control.slow_down(None)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    from tandem.common.engine import Engine

    with Engine(engine_config(tiny_llama)) as engine:
        greedy(engine, [5, 6, 7], 1)  # starts the model thread, which lives as long as the engine
        yield engine


@pytest.fixture(scope="module")
def tok(tiny_llama) -> Tokenizer:
    return Tokenizer.from_file(f"{tiny_llama}/tokenizer.json")


@pytest.fixture(autouse=True)
def no_leaked_threads(request):
    if "engine" in request.fixturenames:
        request.getfixturevalue("engine")  # its threads live for the module
    before = set(threading.enumerate())
    yield
    assert threads_settle(before) == []


@pytest.fixture(autouse=True)
def fast_readiness(monkeypatch):
    monkeypatch.setattr(grpc_api, "READINESS_POLL_S", 0.02)


def greedy(engine, ids: list[int], max_new: int) -> list[int]:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    [result] = engine.generate([GenerateRequest("ref", ids, params)])
    return result.sequences[0].output_ids


def run(engine, model_dir: str, scenario, **router_flags):
    async def main():
        async with router_stack(engine, model_dir, **router_flags) as stack:
            return await scenario(stack)
    return asyncio.run(main())


async def read_stream(call) -> tuple[list[rpb.Chunk], rpb.Usage, set[str]]:
    responses = [r async for r in call]
    assert all(r.HasField("chunk") for r in responses[:-1]) and responses[-1].HasField("usage")
    assert len({r.id for r in responses}) == 1
    return [r.chunk for r in responses[:-1]], responses[-1].usage, {r.id for r in responses}


# ---- streams equal the engine ------------------------------------------------------------------------------

def test_generate_streams_the_engines_greedy_tokens(engine, tiny_llama, tok):
    ids = tok.encode(PROMPT).ids
    expected = greedy(engine, ids, 12)
    params = rpb.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    async def scenario(stack):
        call = stack.stub.Generate(rpb.GenerateRequest(model="tiny", text=PROMPT, sampling_params=params))
        chunks, usage, rids = await read_stream(call)
        metadata = dict(await call.initial_metadata())
        by_ids, _, _ = await read_stream(stack.stub.Generate(rpb.GenerateRequest(
            token_ids=rpb.TokenIds(ids=ids), sampling_params=params)))
        return chunks, usage, rids, metadata, by_ids

    chunks, usage, rids, metadata, by_ids = run(engine, tiny_llama, scenario)
    assert [t for c in chunks for t in c.token_ids] == expected
    assert "".join(c.text for c in chunks) == tok.decode(expected)
    assert chunks[-1].finish_reason == "length" and all(not c.finish_reason for c in chunks[:-1])
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 12)
    assert next(iter(rids)).startswith("cmpl-")
    assert metadata[grpc_api.WEIGHT_VERSION_METADATA] == engine.control.weight_version
    assert [t for c in by_ids for t in c.token_ids] == expected  # a token-id prompt, and no model: the served one


def test_chat_equals_the_engine_on_the_tokenized_conversation(engine, tiny_llama, tok):
    messages = [rpb.ChatMessage(role="system", content="Be brief."),
                rpb.ChatMessage(role="user", content="Hello there", name="ann")]
    request = rpb.ChatRequest(model="tiny", messages=messages, user="u1",
                              sampling_params=rpb.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))

    async def scenario(stack):
        prompt = list((await stack.stub.Tokenize(rpb.TokenizeRequest(chat=request))).tokens)
        chunks, usage, rids = await read_stream(stack.stub.Chat(request))
        return prompt, chunks, usage, rids

    prompt, chunks, usage, rids = run(engine, tiny_llama, scenario)
    expected = greedy(engine, prompt, 8)
    assert [t for c in chunks for t in c.token_ids] == expected
    assert "".join(c.text for c in chunks) == tok.decode(expected)
    assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == 8
    assert next(iter(rids)).startswith("chatcmpl-")


def test_logprobs_and_prompt_logprobs_come_back(engine, tiny_llama, tok):
    ids = tok.encode(PROMPT).ids
    params = rpb.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)

    async def scenario(stack):
        gen = await read_stream(stack.stub.Generate(rpb.GenerateRequest(
            text=PROMPT, sampling_params=params, logprobs=2, prompt_logprobs=True)))
        chat = await read_stream(stack.stub.Chat(rpb.ChatRequest(messages=HI, sampling_params=params,
                                                                 logprobs=True, top_logprobs=3)))
        return gen, chat

    (chunks, usage, _), (chat_chunks, _, _) = run(engine, tiny_llama, scenario)
    for chunk_list, top_n in ((chunks, 2), (chat_chunks, 3)):
        entries = [e for c in chunk_list for e in c.logprobs]
        assert [e.token_id for e in entries] == [t for c in chunk_list for t in c.token_ids]
        for e in entries:  # greedy: the chosen token is the most likely one
            assert len(e.top_logprobs) == top_n and e.top_logprobs[0].token_id == e.token_id
            assert math.isclose(e.top_logprobs[0].logprob, e.logprob, abs_tol=1e-5) and e.logprob <= 0
            assert e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
    assert len(usage.prompt_logprobs) == len(ids)
    assert not usage.prompt_logprobs[0].HasField("logprob")  # the first prompt token has none
    assert all(p.HasField("logprob") and p.logprob <= 0 for p in usage.prompt_logprobs[1:])


def test_sampling_fields_reach_the_worker(engine, tiny_llama, tok):
    ids = tok.encode(PROMPT).ids
    expected = greedy(engine, ids, 8)
    forced = expected[0] + 1

    async def scenario(stack):
        def generate(echo=False, **sampling):
            sampling = {"max_tokens": 8, "temperature": 0, **sampling}
            return read_stream(stack.stub.Generate(rpb.GenerateRequest(
                text=PROMPT, echo=echo, sampling_params=rpb.SamplingParams(**sampling))))
        stop = await generate(stop_token_ids=[expected[3]], include_stop_str_in_output=True)
        biased = await generate(logit_bias={forced: 100.0}, ignore_eos=True)
        two = await generate(n=2, temperature=1.0, seed=7, ignore_eos=True, min_tokens=8)
        echoed = await generate(echo=True, max_tokens=2, ignore_eos=True)
        return stop, biased, two, echoed

    stop, biased, two, echoed = run(engine, tiny_llama, scenario)
    assert "".join(c.text for c in echoed[0]) == PROMPT + tok.decode(expected[:2])
    first_stop = expected.index(expected[3])
    assert [t for c in stop[0] for t in c.token_ids] == expected[:first_stop]  # the stop token is not output
    assert stop[0][-1].finish_reason == "stop" and stop[1].completion_tokens == first_stop + 1
    assert [t for c in biased[0] for t in c.token_ids] == [forced] * 8
    assert sorted({c.index for c in two[0]}) == [0, 1] and two[1].completion_tokens == 16


# ---- errors ------------------------------------------------------------------------------------------------

BAD_REQUESTS = [
    ("Generate", rpb.GenerateRequest(text="x", sampling_params=rpb.SamplingParams(temperature=math.nan)),
     grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("Generate", rpb.GenerateRequest(text="x", sampling_params=rpb.SamplingParams(temperature=math.inf)),
     grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("Generate", rpb.GenerateRequest(text="x", sampling_params=rpb.SamplingParams(top_p=0)),
     grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ("Generate", rpb.GenerateRequest(text="x", sampling_params=rpb.SamplingParams(logit_bias={5: 500.0})),
     grpc.StatusCode.INVALID_ARGUMENT, "logit_bias"),
    ("Generate", rpb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ("Generate", rpb.GenerateRequest(token_ids=rpb.TokenIds(ids=[10 ** 9])), grpc.StatusCode.INVALID_ARGUMENT,
     "prompt"),
    ("Generate", rpb.GenerateRequest(text="x", response_format=rpb.ResponseFormat(type="json_schema",
                                                                                  json_schema="{nope")),
     grpc.StatusCode.INVALID_ARGUMENT, "response_format.json_schema"),
    ("Generate", rpb.GenerateRequest(text="x", model="nope"), grpc.StatusCode.NOT_FOUND, "model"),
    ("Chat", rpb.ChatRequest(), grpc.StatusCode.INVALID_ARGUMENT, "messages"),
    ("Chat", rpb.ChatRequest(messages=HI, tools=[rpb.Tool(name="f", parameters="[1")]),
     grpc.StatusCode.INVALID_ARGUMENT, "tools[0].parameters"),
    ("Chat", rpb.ChatRequest(messages=HI, tools=[rpb.Tool(name="f")]), grpc.StatusCode.INVALID_ARGUMENT,
     "tool_choice"),  # auto needs --tool-call-parser
    ("Chat", rpb.ChatRequest(messages=HI, chat_template_kwargs="{x"), grpc.StatusCode.INVALID_ARGUMENT,
     "chat_template_kwargs"),
    ("Chat", rpb.ChatRequest(messages=HI, chat_template_kwargs='{"a": NaN}'), grpc.StatusCode.INVALID_ARGUMENT,
     "a: must be a finite number"),  # the JSON rules of an HTTP body: the key is named
    ("Chat", rpb.ChatRequest(messages=HI, model="nope"), grpc.StatusCode.NOT_FOUND, "model"),
]


def test_bad_requests_fail_with_the_field_named(engine, tiny_llama):
    async def scenario(stack):
        outcomes = []
        for method, request, _, _ in BAD_REQUESTS:
            call = getattr(stack.stub, method)(request)
            try:
                await read_stream(call)
                outcomes.append(None)
            except grpc.aio.AioRpcError as e:
                outcomes.append((e.code(), e.details(), dict(await call.initial_metadata())))
        await stack.settled()
        return outcomes, stack.gateway.admission.running

    outcomes, running = run(engine, tiny_llama, scenario)
    for (method, request, code, field), outcome in zip(BAD_REQUESTS, outcomes):
        assert outcome is not None, (method, request)
        assert outcome[0] == code and outcome[1].startswith(field), (method, request, outcome)
        assert grpc_api.WEIGHT_VERSION_METADATA not in outcome[2]  # refused before any worker answered
    assert running == 0


def test_a_full_queue_is_resource_exhausted_with_retry_after(slowed, tiny_llama):
    async def scenario(stack):
        first = stack.stub.Generate(rpb.GenerateRequest(text=PROMPT, sampling_params=LONG))
        await first.read()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await read_stream(stack.stub.Generate(rpb.GenerateRequest(text=PROMPT)))
        first.cancel()
        await stack.settled()
        return refused.value

    refused = run(slowed, tiny_llama, scenario, max_running_requests=1, max_queued_requests=0)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in refused.details()
    assert dict(refused.trailing_metadata())["retry-after"] == "1"


def test_an_api_key_is_required_on_every_call(engine, tiny_llama):
    async def scenario(stack):
        calls = [lambda **kw: read_stream(stack.stub.Generate(rpb.GenerateRequest(text="x"), **kw)),
                 lambda **kw: read_stream(stack.stub.Chat(rpb.ChatRequest(messages=HI), **kw)),
                 lambda **kw: stack.stub.ListModels(rpb.ListModelsRequest(), **kw),
                 lambda **kw: stack.stub.Embed(rpb.EmbedRequest(texts=["x"]), **kw),
                 lambda **kw: stack.stub.Tokenize(rpb.TokenizeRequest(text="x"), **kw),
                 lambda **kw: stack.stub.Detokenize(rpb.DetokenizeRequest(tokens=[5]), **kw)]
        codes = []
        for call in calls:
            for metadata in ((), (("authorization", "Bearer wrong"),)):
                try:
                    await call(metadata=metadata)
                    codes.append(None)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
        allowed = await stack.stub.ListModels(rpb.ListModelsRequest(), metadata=(("authorization", "Bearer k"),))
        return codes, allowed

    codes, allowed = run(engine, tiny_llama, scenario, api_key="k")
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 12
    assert [m.id for m in allowed.models] == ["tiny"]


# ---- cancellation and deadlines ----------------------------------------------------------------------------

def test_cancelling_a_stream_aborts_the_request_at_the_worker(slowed, tiny_llama):
    async def scenario(stack):
        call = stack.stub.Chat(rpb.ChatRequest(messages=HI, sampling_params=LONG))
        first = await call.read()
        running = set(stack.servicer.in_flight)
        call.cancel()
        idle = await stack.settled()
        return first, running, idle, stack.gateway.admission.running, await call.code()

    first, running, idle, admitted, code = run(slowed, tiny_llama, scenario)
    assert first.HasField("chunk") and len(running) == 1  # it was running at the worker...
    assert idle.num_running_reqs == 0 and admitted == 0  # ...and nothing is, once the client cancelled
    assert code == grpc.StatusCode.CANCELLED


def test_a_client_deadline_ends_the_request_at_the_worker(slowed, tiny_llama):
    async def scenario(stack):
        call = stack.stub.Generate(rpb.GenerateRequest(text=PROMPT, sampling_params=LONG), timeout=0.25)
        with pytest.raises(grpc.aio.AioRpcError) as expired:
            await read_stream(call)
        await stack.settled()
        return expired.value.code(), stack.gateway.admission.running

    assert run(slowed, tiny_llama, scenario) == (grpc.StatusCode.DEADLINE_EXCEEDED, 0)


def test_the_routers_request_timeout_ends_a_stream_already_under_way(slowed, tiny_llama):
    async def scenario(stack):
        call = stack.stub.Generate(rpb.GenerateRequest(text=PROMPT, sampling_params=LONG))
        chunks = []
        with pytest.raises(grpc.aio.AioRpcError) as expired:
            async for response in call:
                chunks.append(response)
        await stack.settled()
        return chunks, expired.value, dict(await call.initial_metadata())

    chunks, expired, metadata = run(slowed, tiny_llama, scenario, request_timeout_s=0.25)
    assert chunks and all(r.HasField("chunk") for r in chunks)  # tokens went out before the timeout
    assert expired.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "--request-timeout-s" in expired.details()
    assert grpc_api.WEIGHT_VERSION_METADATA in metadata  # sent once, with the first chunk


# ---- the other calls ---------------------------------------------------------------------------------------

def test_list_models_tokenize_and_detokenize(engine, tiny_llama, tok):
    ids = tok.encode(PROMPT, add_special_tokens=False).ids

    async def scenario(stack):
        stub = stack.stub
        models = await stub.ListModels(rpb.ListModelsRequest())
        text = await stub.Tokenize(rpb.TokenizeRequest(model="tiny", text=PROMPT, add_special_tokens=False))
        detok = await stub.Detokenize(rpb.DetokenizeRequest(model="tiny", tokens=ids))
        chat = rpb.ChatRequest(messages=HI)
        with_prompt = await stub.Tokenize(rpb.TokenizeRequest(chat=chat))
        without = await stub.Tokenize(rpb.TokenizeRequest(chat=rpb.ChatRequest(messages=HI,
                                                                               add_generation_prompt=False)))
        errors = []
        for call in (stub.Tokenize(rpb.TokenizeRequest(model="nope", text="x")),
                     stub.Detokenize(rpb.DetokenizeRequest(tokens=[10 ** 9])),
                     stub.Tokenize(rpb.TokenizeRequest(chat=rpb.ChatRequest(messages=HI, chat_template_kwargs="[")))):
            try:
                await call
                errors.append(None)
            except grpc.aio.AioRpcError as e:
                errors.append((e.code(), e.details().split(":")[0]))
        return models, text, detok, with_prompt, without, errors

    models, text, detok, with_prompt, without, errors = run(engine, tiny_llama, scenario)
    assert [(m.id, m.max_model_len) for m in models.models] == [("tiny", MAX_CONTEXT_LEN)]
    assert list(text.tokens) == ids and text.max_model_len == MAX_CONTEXT_LEN
    assert detok.text == PROMPT
    assert list(with_prompt.tokens)[:len(without.tokens)] == list(without.tokens)
    assert len(with_prompt.tokens) > len(without.tokens)  # the assistant header
    assert errors == [(grpc.StatusCode.NOT_FOUND, "model"), (grpc.StatusCode.INVALID_ARGUMENT, "tokens"),
                      (grpc.StatusCode.INVALID_ARGUMENT, "chat_template_kwargs")]


def test_embed_equals_the_engine(engine, tiny_llama, tok):
    texts = ["The little cat", "a"]
    ids = [tok.encode(t).ids for t in texts]
    vectors = [engine.embed(f"e{i}", p).result(timeout=60).embedding for i, p in enumerate(ids)]

    async def scenario(stack):
        by_text = await stack.stub.Embed(rpb.EmbedRequest(model="tiny", texts=texts, dimensions=len(vectors[0])))
        by_ids = await stack.stub.Embed(rpb.EmbedRequest(token_ids=[rpb.TokenIds(ids=i) for i in ids]))
        errors = []
        for request in (rpb.EmbedRequest(texts=["x"], token_ids=[rpb.TokenIds(ids=[5])]),
                        rpb.EmbedRequest(texts=["x"], dimensions=3), rpb.EmbedRequest(texts=["x"], model="nope")):
            try:
                await stack.stub.Embed(request)
                errors.append(None)
            except grpc.aio.AioRpcError as e:
                errors.append((e.code(), e.details().split(":")[0]))
        return by_text, by_ids, errors

    by_text, by_ids, errors = run(engine, tiny_llama, scenario)
    for reply in (by_text, by_ids):
        assert reply.model == "tiny" and [d.index for d in reply.data] == [0, 1]
        assert reply.prompt_tokens == sum(len(i) for i in ids)
        for d, want in zip(reply.data, vectors):
            assert len(d.values) == len(want) and max(abs(a - b) for a, b in zip(d.values, want)) < 1e-5
    assert errors == [(grpc.StatusCode.INVALID_ARGUMENT, "input"), (grpc.StatusCode.INVALID_ARGUMENT, "dimensions"),
                      (grpc.StatusCode.NOT_FOUND, "model")]


def test_health_follows_readiness_and_reflection_lists_the_services(engine, tiny_llama):
    async def status(channel, service: str) -> int:
        stub = health_pb2_grpc.HealthStub(channel)
        return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status

    async def until(channel, want: int) -> list[int]:
        for _ in range(250):
            states = [await status(channel, s) for s in ("", grpc_api.SERVICE_NAME)]
            if states == [want, want]:
                break
            await asyncio.sleep(0.02)
        return states

    async def scenario(stack):
        serving = await until(stack.channel, health_pb2.HealthCheckResponse.SERVING)
        reflection = reflection_pb2_grpc.ServerReflectionStub(stack.channel)
        replies = [r async for r in reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]))]
        await stack.worker.drain(0.0)  # the worker goes: its health checks fail, the router is not ready
        not_serving = await until(stack.channel, health_pb2.HealthCheckResponse.NOT_SERVING)
        with pytest.raises(grpc.aio.AioRpcError) as unavailable:
            await read_stream(stack.stub.Generate(rpb.GenerateRequest(text="x")))
        return serving, replies, not_serving, unavailable.value.code()

    serving, replies, not_serving, code = run(engine, tiny_llama, scenario)
    assert serving == [health_pb2.HealthCheckResponse.SERVING] * 2
    names = {s.name for s in replies[0].list_services_response.service}
    assert {grpc_api.SERVICE_NAME, "grpc.health.v1.Health"} <= names
    assert not_serving == [health_pb2.HealthCheckResponse.NOT_SERVING] * 2
    assert code == grpc.StatusCode.UNAVAILABLE


def test_a_router_without_its_tokenizer_yet(tiny_llama):
    """Before the tokenizer is fetched from a worker: ListModels answers (no length yet), Embed is UNAVAILABLE,
    health is NOT_SERVING."""
    async def scenario():
        gateway = Gateway(RouterConfig(workers=[WorkerEndpoint("unified", "127.0.0.1", 1)]))
        api = GrpcApi(gateway)
        port = await api.start("127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = rpb_grpc.RouterStub(channel)
                models = await stub.ListModels(rpb.ListModelsRequest())
                with pytest.raises(grpc.aio.AioRpcError) as embed:
                    await stub.Embed(rpb.EmbedRequest(texts=["x"]))
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                return models, embed.value, health.status
        finally:
            await api.stop()
            await gateway.stop()

    models, embed, health = asyncio.run(scenario())
    assert [(m.id, m.max_model_len) for m in models.models] == [("tandem", 0)]
    assert embed.code() == grpc.StatusCode.UNAVAILABLE and "tokenizer" in embed.details()
    assert health == health_pb2.HealthCheckResponse.NOT_SERVING



# ---- trace context -----------------------------------------------------------------------------------------

def test_a_clients_trace_context_is_continued_and_named(engine, tiny_llama, monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_enabled", True)  # as setup_tracing leaves it, without the global provider
    monkeypatch.setattr(tracing, "get_tracer", lambda: provider.get_tracer("test"))
    trace_id, parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    metadata = (("traceparent", f"00-{trace_id}-{parent}-01"),)

    async def scenario(stack):
        ok = stack.stub.Chat(rpb.ChatRequest(messages=HI, sampling_params=rpb.SamplingParams(max_tokens=2)),
                             metadata=metadata)
        await read_stream(ok)
        bad = stack.stub.Chat(rpb.ChatRequest(), metadata=metadata)
        with pytest.raises(grpc.aio.AioRpcError):
            await read_stream(bad)
        return dict(await ok.initial_metadata()), dict(await bad.initial_metadata())

    try:
        ok, bad = run(engine, tiny_llama, scenario)
    finally:
        provider.shutdown()
    assert ok["x-trace-id"] == trace_id and bad["x-trace-id"] == trace_id  # an error names its trace too
    spans = [s for s in exporter.get_finished_spans() if s.name == tracing.ROUTER_REQUEST]
    assert len(spans) == 2 and all(s.parent.span_id == int(parent, 16) for s in spans)
    assert {s.attributes["rpc.method"] for s in spans} == {"ChatRequest"}
    assert all(s.attributes["rpc.system"] == "grpc" for s in spans)


# ---- the conversions at the edge ---------------------------------------------------------------------------

def test_requests_become_the_http_bodies():
    sampling = rpb.SamplingParams(temperature=0.1, top_p=0.9, top_k=5, stop=["."], stop_token_ids=[2],
                                  logit_bias={7: -1.5}, include_stop_str_in_output=True, seed=3)
    body = grpc_api.completion_body(rpb.GenerateRequest(
        text="p", sampling_params=sampling, logprobs=0, user="u", echo=True, prompt_logprobs=True,
        response_format=rpb.ResponseFormat(type="json_schema", name="s", strict=True, json_schema='{"type": "object"}')))
    assert body == {"temperature": 0.1, "top_p": 0.9, "top_k": 5, "seed": 3, "stop": ["."], "stop_token_ids": [2],
                    "logit_bias": {"7": -1.5}, "include_stop_str_in_output": True, "prompt": "p", "logprobs": 0,
                    "user": "u", "echo": True, "prompt_logprobs": 0,
                    "response_format": {"type": "json_schema", "json_schema": {
                        "name": "s", "strict": True, "schema": {"type": "object"}}}}
    messages = [rpb.ChatMessage(role="assistant", reasoning_content="hm",
                                tool_calls=[rpb.ToolCall(id="c1", name="f")]),
                rpb.ChatMessage(role="tool", tool_call_id="c1", content="21C")]
    chat = rpb.ChatRequest(model="m", messages=messages, tools=[rpb.Tool(name="f", description="d")],
                           tool_choice=rpb.ToolChoice(function="f"), chat_template_kwargs='{"k": 1}',
                           continue_final_message=True, add_generation_prompt=False,
                           response_format=rpb.ResponseFormat(type="json_object"))
    assert grpc_api.chat_body(chat) == {
        "model": "m", "messages": [
            {"role": "assistant", "content": "", "reasoning_content": "hm", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "content": "21C", "tool_call_id": "c1"}],
        "tools": [{"type": "function", "function": {"name": "f", "description": "d"}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}, "chat_template_kwargs": {"k": 1},
        "add_generation_prompt": False, "continue_final_message": True, "response_format": {"type": "json_object"}}
    assert grpc_api.chat_template_fields(rpb.ChatRequest(tool_choice=rpb.ToolChoice(mode="required"))) == {
        "tool_choice": "required"}


def test_deltas_and_usage_become_messages():
    delta = ChoiceDelta(index=1, text="hi", token_ids=[4, 5], finish_reason="tool_calls", reasoning="r",
                        tool_calls=[ToolCallDelta(index=0, id="c1", name="f", arguments='{"a"')],
                        logprobs=[LogprobEntry(4, "h", -0.5, top=[(4, "h", -0.5), (9, "x", -2.0)])])
    chunk = grpc_api.chunk_message("r1", delta)
    assert chunk.id == "r1" and chunk.chunk.index == 1 and list(chunk.chunk.token_ids) == [4, 5]
    assert (chunk.chunk.text, chunk.chunk.finish_reason, chunk.chunk.reasoning_content) == ("hi", "tool_calls", "r")
    [call] = chunk.chunk.tool_calls
    assert (call.index, call.id, call.name, call.arguments) == (0, "c1", "f", '{"a"')
    [entry] = chunk.chunk.logprobs
    assert [(t.token_id, t.token, t.logprob) for t in entry.top_logprobs] == [(4, "h", -0.5), (9, "x", -2.0)]
    usage = grpc_api.usage_message("r1", Usage(3, 2, 1, prompt_logprobs=[None, -1.5, -0.25])).usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (3, 2, 1)
    assert [p.logprob if p.HasField("logprob") else None for p in usage.prompt_logprobs] == [None, -1.5, -0.25]
