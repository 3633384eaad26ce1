"""The router in front of one `tandem worker`, driven by the official `openai` client and plain HTTP."""

from __future__ import annotations

import time

import json
import re
import urllib.error
import urllib.request

import openai
import pytest
from tokenizers import Tokenizer

pytestmark = pytest.mark.e2e

PROMPT = "The little cat sat on the"


def post(router, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(router.url + path, data=data, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def ref_engine(tiny_llama):
    from tandem.common.config import EngineConfig
    from tandem.common.engine import Engine

    config = EngineConfig(model_path=tiny_llama, max_total_tokens=4096, page_size=4, max_context_len=1024)
    with Engine(config) as engine:
        yield engine


def test_greedy_completion_equals_the_in_process_engine(client, ref_engine, tiny_llama):
    from tandem.common.sampling.params import SamplingParams
    from tandem.common.scheduler.io_struct import GenerateRequest

    tok = Tokenizer.from_file(f"{tiny_llama}/tokenizer.json")
    ids = tok.encode(PROMPT).ids
    [result] = ref_engine.generate([GenerateRequest("ref", ids, SamplingParams(max_new_tokens=24, temperature=0.0,
                                                                                ignore_eos=True))])
    expected = tok.decode(result.sequences[0].output_ids, skip_special_tokens=True)
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, extra_body={
        "ignore_eos": True})
    assert reply.choices[0].text == expected
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 24
    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected


def test_chat_streaming_and_not(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=12, temperature=0)
    text = reply.choices[0].message.content
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=12,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 4  # the same prompt was just served


def test_n_choices_are_all_returned(client):
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=7,
                                      extra_body={"ignore_eos": True})
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    assert reply.usage.completion_tokens == 24
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=2, stream=True,
                                       extra_body={"ignore_eos": True})
    finished = {c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> str:
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2, 3))


def test_stop_string_is_trimmed_and_ends_the_choice(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[6:9]
    assert len(stop) == 3 and stop.strip()
    cut = full[:full.index(stop)]
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                      extra_body={"ignore_eos": True})
    assert reply.choices[0].text == cut and reply.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                              stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_logprobs_for_completions_and_chat(client):
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                      extra_body={"ignore_eos": True})
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(x <= 0 for x in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    # greedy: the chosen token is the most likely one (tokens with equal text share a key: compare with >=)
    assert all(x >= max(t.values()) - 1e-4 for t, x in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=4, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content


def test_errors_have_openai_shape_and_status(client, router):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=3)
    assert "temperature" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=5000)
    assert info.value.body["param"] == "max_tokens" and "context length" in info.value.message
    status, body = post(router, "/v1/chat/completions", b"{not json")
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    status, body = post(router, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens" and "echo" in body["error"]["message"]
    status, body = post(router, "/v1/completions", {"prompt": "x", "max_tokenz": 3})
    assert status == 400 and body["error"]["param"] == "max_tokenz" and "unknown field" in body["error"]["message"]


def test_models_and_metrics(client, router):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with urllib.request.urlopen(router.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert "tandem_prefix_cache_hit_tokens_total" in text and "tandem_prefix_cache_query_tokens_total" in text
    # labels are sorted (model_name, role, worker): match the role wherever it sits
    assert re.search(r'tandem_router_worker_healthy\{[^}]*role="unified"', text)


def test_grpc_api_generates_and_maps_errors(router):
    import grpc

    from tandem.common.proto_gen.tandem import router_pb2 as rpb
    from tandem.common.proto_gen.tandem import router_pb2_grpc as rpb_grpc

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
        # The gRPC health status follows the router's readiness (polled); give it a moment to settle.
        deadline = time.monotonic() + 10
        while True:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="tandem.router.v1.Router"))
            if health.status == health_pb2.HealthCheckResponse.SERVING:
                break
            assert time.monotonic() < deadline, f"router gRPC health stayed {health.status}"
            time.sleep(0.1)
        stub = rpb_grpc.RouterStub(channel)
        request = rpb.GenerateRequest(model="tiny", text=PROMPT, sampling_params=rpb.SamplingParams(
            max_tokens=6, temperature=0, ignore_eos=True), logprobs=1)
        responses = list(stub.Generate(request))
        assert responses[-1].HasField("usage") and responses[-1].usage.completion_tokens == 6
        chunks = [r.chunk for r in responses if r.HasField("chunk")]
        assert sum(len(c.token_ids) for c in chunks) == 6 and chunks[-1].finish_reason == "length"
        chat = list(stub.Chat(rpb.ChatRequest(model="tiny", messages=[rpb.ChatMessage(role="user", content="hi")],
                                              sampling_params=rpb.SamplingParams(max_tokens=3))))
        assert chat[-1].HasField("usage")
        for bad, code in ((rpb.GenerateRequest(model="tiny", text="x", sampling_params=rpb.SamplingParams(top_p=2)),
                           grpc.StatusCode.INVALID_ARGUMENT),
                          (rpb.GenerateRequest(model="other", text="x"), grpc.StatusCode.NOT_FOUND)):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(bad))
            assert info.value.code() == code
