"""The router's gRPC API (tandem.router.v1) gains what HTTP has: tools and template options, Tokenize and
Detokenize; docs/api.md's Python client runs as written; the .proto ships inside the package."""

from __future__ import annotations

import importlib.resources
import json
import os
import re
import subprocess
import sys
import urllib.request

import grpc
import pytest

from tandem.common.proto_gen.tandem import router_pb2 as rpb
from tandem.common.proto_gen.tandem import router_pb2_grpc as rpb_grpc
from tests.services.router.conftest import REPO_ROOT


def http(router, path: str, body: dict) -> dict:
    request = urllib.request.Request(router.url + path, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def stub(router):
    with grpc.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
        yield rpb_grpc.RouterStub(channel)


def docs_grpc_client() -> str:
    with open(os.path.join(REPO_ROOT, "docs", "api.md")) as f:
        readme = f.read()
    section = readme[readme.index("## gRPC"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.e2e
def test_the_api_docs_client_streams_a_chat(router):
    env = {**os.environ, "TANDEM_GRPC": f"127.0.0.1:{router.grpc_port}"}
    out = subprocess.run([sys.executable, "-c", docs_grpc_client()], env=env, cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    reference = http(router, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Write one short sentence."}], "max_tokens": 24, "temperature": 0})
    usage = reference["usage"]
    assert out.stdout == (reference["choices"][0]["message"]["content"] +
                          f"\n[{usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens]\n")


@pytest.mark.e2e
def test_tokenize_and_detokenize_match_http(router, stub):
    messages = [rpb.ChatMessage(role="user", content="Weather?"),
                rpb.ChatMessage(role="assistant", tool_calls=[rpb.ToolCall(id="c1", name="get_weather",
                                                                           arguments='{"city": "Paris"}')]),
                rpb.ChatMessage(role="tool", tool_call_id="c1", content="21C")]
    tools = [rpb.Tool(name="get_weather", parameters='{"type": "object"}')]
    ours = stub.Tokenize(rpb.TokenizeRequest(chat=rpb.ChatRequest(messages=messages, tools=tools)))
    reference = http(router, "/tokenize", {
        "messages": [{"role": "user", "content": "Weather?"},
                     {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                         "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "21C"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]})
    assert list(ours.tokens) == reference["tokens"] and ours.max_model_len == reference["max_model_len"]
    text = stub.Detokenize(rpb.DetokenizeRequest(tokens=ours.tokens)).text
    assert "<tool_call>" in text and "<tool_response>\n21C\n</tool_response>" in text


@pytest.mark.e2e
def test_chat_with_tools_and_clear_errors(stub):
    request = rpb.ChatRequest(messages=[rpb.ChatMessage(role="user", content="hi")],
                              tools=[rpb.Tool(name="f")], tool_choice=rpb.ToolChoice(mode="none"),
                              sampling_params=rpb.SamplingParams(max_tokens=3))
    assert list(stub.Chat(request))[-1].HasField("usage")
    for bad, field in ((rpb.ChatRequest(messages=request.messages, tools=request.tools), "tool_choice"),
                       (rpb.ChatRequest(messages=request.messages, chat_template_kwargs="{x"), "chat_template_kwargs"),
                       (rpb.ChatRequest(messages=request.messages, tools=[rpb.Tool(name="f", parameters="[1")]),
                        "tools[0].parameters")):
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Chat(bad))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith(field)


def test_the_proto_ships_inside_the_package():
    shipped = (importlib.resources.files("tandem.services.router") / "router.proto").read_text()
    with open(os.path.join(REPO_ROOT, "proto", "tandem", "router.proto")) as f:
        assert shipped == f.read() and "rpc Tokenize" in shipped
