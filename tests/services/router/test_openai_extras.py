"""The rest of the API vLLM and SGLang users expect, through a real router and worker: optional model, echo,
lists of prompts, include_stop_str_in_output, prompt_logprobs, top_logprobs with the sampled token, /tokenize
and /detokenize, SGLang's info endpoints, OpenAI-shaped 404/405, X-Request-Id, tool history in chat, and a
--chat-template file rendered exactly as transformers renders it."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest

from tests.services.router.conftest import RouterProcess, readiness, wait_until

pytestmark = pytest.mark.e2e

PROMPT = "The little cat sat on the"
DATA = os.path.join(os.path.dirname(__file__), "data", "chat_templates")


def call(router, path: str, body=None, method: str = "POST", headers: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(router.url + path, data=data, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            raw, status, got = resp.read(), resp.status, resp.headers
    except urllib.error.HTTPError as e:
        raw, status, got = e.read(), e.code, e.headers
    text = raw.decode()
    return status, (json.loads(text) if text.startswith("{") else text), got


def complete(router, **body):
    status, reply, _ = call(router, "/v1/completions", {"max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                                         **body})
    assert status == 200, reply
    return reply


def test_model_is_optional_and_echo_prefixes_the_prompt(router):
    plain = complete(router, prompt=PROMPT)
    echoed = complete(router, prompt=PROMPT, echo=True)
    assert plain["model"] == "tiny" and echoed["choices"][0]["text"] == PROMPT + plain["choices"][0]["text"]


def test_a_list_of_prompts_gives_n_choices_each_in_order(router):
    second = [5, 6, 7, 8]
    singles = [complete(router, prompt=p)["choices"][0]["text"] for p in (PROMPT, second)]
    batch = complete(router, prompt=[PROMPT, second], n=2)
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in batch["choices"]] == [singles[0], singles[0], singles[1], singles[1]]
    assert batch["usage"]["completion_tokens"] == 24
    status, stream, _ = call(router, "/v1/completions", {"prompt": [PROMPT, second], "max_tokens": 6, "temperature": 0,
                                                         "ignore_eos": True, "stream": True})
    texts = {0: "", 1: ""}
    for line in stream.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                texts[choice["index"]] += choice["text"]
    assert status == 200 and texts == {0: singles[0], 1: singles[1]}


def test_include_stop_str_in_output(router):
    text = complete(router, prompt=PROMPT, max_tokens=16)["choices"][0]["text"]
    stop = text[3:5]
    cut = text[:text.index(stop)]
    with_stop = complete(router, prompt=PROMPT, max_tokens=16, stop=[stop], include_stop_str_in_output=True)
    assert with_stop["choices"][0]["text"] == cut + stop and with_stop["choices"][0]["finish_reason"] == "stop"


def test_prompt_logprobs_and_top_logprobs_hold_the_sampled_token(router):
    reply = complete(router, prompt=PROMPT, prompt_logprobs=0, logprobs=1, temperature=1.0, seed=7, max_tokens=8)
    choice = reply["choices"][0]
    prompt_lps = choice["prompt_logprobs"]
    assert len(prompt_lps) == reply["usage"]["prompt_tokens"] and prompt_lps[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in prompt_lps[1:])
    lp = choice["logprobs"]
    assert all(token in top for token, top in zip(lp["tokens"], lp["top_logprobs"]))
    status, chat, _ = call(router, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                            "max_completion_tokens": 2, "prompt_logprobs": 0})
    assert status == 200 and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_tokenize_and_detokenize(router):
    status, reply, _ = call(router, "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert status == 200 and reply["count"] == len(reply["tokens"]) == len(reply["token_strs"])
    status, back, _ = call(router, "/detokenize", {"tokens": reply["tokens"]})
    assert status == 200 and back["prompt"].endswith(PROMPT)
    messages = [{"role": "user", "content": "hi"}]
    _, chat_tokens, _ = call(router, "/tokenize", {"messages": messages})
    status, chat, _ = call(router, "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 1})
    assert status == 200 and chat["usage"]["prompt_tokens"] == chat_tokens["count"]
    status, error, _ = call(router, "/detokenize", {"tokens": [10**9]})
    assert status == 400 and error["error"]["param"] == "tokens"


def test_info_endpoints(router):
    assert call(router, "/v1/models/tiny", method="GET")[1]["id"] == "tiny"
    status, error, _ = call(router, "/v1/models/other", method="GET")
    assert status == 404 and error["error"]["code"] == "model_not_found"
    assert call(router, "/version", method="GET")[1]["version"]
    assert call(router, "/get_model_info", method="GET")[1]["is_generation"] is True
    info = call(router, "/get_server_info", method="GET")[1]
    assert info["router_args"]["served_model_name"] == "tiny" and "api_key" not in info["router_args"]
    status, flushed, _ = call(router, "/flush_cache")
    assert status == 200 and flushed["success"], flushed
    status, health, _ = call(router, "/health_generate", method="GET")
    assert status == 200 and health["completion_tokens"] == 1
    status, doc, _ = call(router, "/openapi.json", method="GET")
    assert status == 200 and "/v1/chat/completions" in doc["paths"]
    status, page, _ = call(router, "/docs", method="GET")
    assert status == 200 and "/openapi.json" in page


def test_routing_errors_are_openai_json_and_every_response_has_a_request_id(router):
    status, body, headers = call(router, "/v1/nothing", {})
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"} and headers["X-Request-Id"]
    status, body, _ = call(router, "/v1/completions", method="GET")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    _, reply, headers = call(router, "/v1/completions", {"prompt": "x", "max_tokens": 1},
                             headers={"X-Request-Id": "client-42"})
    assert headers["X-Request-Id"] == "client-42"
    _, reply, headers = call(router, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert headers["X-Request-Id"] == reply["id"]


def test_chat_with_tool_history_renders_and_auto_needs_a_parser(router):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "21C"}]
    status, reply, _ = call(router, "/v1/chat/completions", {"messages": messages, "tools": tools,
                                                             "tool_choice": "none", "max_completion_tokens": 3})
    assert status == 200, reply
    _, tokens, _ = call(router, "/tokenize", {"messages": messages, "tools": tools})
    assert reply["usage"]["prompt_tokens"] == tokens["count"]
    status, error, _ = call(router, "/v1/chat/completions", {"messages": messages, "tools": tools})
    assert status == 400 and error["error"]["param"] == "tool_choice" and "--tool-call-parser" in error["error"]["message"]


@pytest.fixture(scope="module")
def qwen3_router(worker_address, tiny_llama):
    proc = RouterProcess("--worker", f"grpc://{worker_address}", "--model-path", tiny_llama, "--served-model-name",
                         "tiny", "--chat-template", os.path.join(DATA, "qwen3.jinja"), "--tool-call-parser", "hermes",
                         "--reasoning-parser", "qwen3")
    wait_until(lambda: readiness(proc) == 200, 60, "router readiness")
    yield proc
    assert proc.stop() == 0


def test_chat_template_file_and_its_kwargs_render_as_transformers(qwen3_router, tiny_llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    with open(os.path.join(DATA, "qwen3.jinja")) as f:
        template = f.read()
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "3+3?"}]
    for kwargs in ({}, {"enable_thinking": False}):
        expected = tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                                 tokenize=False, **kwargs)
        status, reply, _ = call(qwen3_router, "/tokenize", {"messages": messages, "chat_template_kwargs": kwargs})
        assert status == 200 and reply["tokens"] == tokenizer.encode(expected, add_special_tokens=False)
    status, reply, _ = call(qwen3_router, "/v1/chat/completions", {
        "messages": messages, "max_completion_tokens": 4, "chat_template_kwargs": {"enable_thinking": False},
        "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert status == 200 and reply["choices"][0]["finish_reason"] in ("length", "stop", "tool_calls"), reply


def test_a_batch_stream_dropped_midway_leaves_nothing_on_the_worker(router, worker_address):
    import socket

    from tandem.common.bench.chaos import leaked

    body = json.dumps({"prompt": [PROMPT, "Once upon a time"], "n": 2, "max_tokens": 900, "ignore_eos": True,
                       "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", router.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    seen = b""
    while seen.count(b"data: ") < 4:
        data = sock.recv(4096)
        assert data, "the stream ended early"
        seen += data
    sock.close()  # the client goes away with four sequences of two prompts still running
    # 3 s: far less than 4 x 900 tokens take, so only the router's aborts can empty the worker in time
    assert leaked(int(worker_address.rsplit(":", 1)[1]), settle_s=3) == {"requests": 0, "kv_tokens": 0}
