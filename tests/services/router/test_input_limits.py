"""Bounded work per request on a real router: bad input is a 400 naming the field, a prompt that cannot fit is
refused before it is tokenized, an over-limit body is a 413, and /health answers while a prompt is processed."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request

import pytest

from tandem.services.router.gateway import MIN_REQUEST_BODY_BYTES
from tandem.services.router.tokenizer import load_tokenizer_assets
from tests.services.router.conftest import RouterProcess, readiness, wait_until

pytestmark = pytest.mark.e2e

CONTEXT = 1024  # the worker's --max-context-len (conftest.WORKER_FLAGS)
LONG_TOKEN = "<|" + "long" * 1024 + "|>"  # 4,100 characters: lifts the character bound to ~4.2 M
SLOW_TEMPLATE = (  # ChatML, after 80 M loop steps (seconds) when the first message is "slow" (sandbox range <= 100k)
    "{% if messages[0]['content'] == 'slow' %}{% for i in range(800) %}{% for j in range(100000) %}"
    "{% if j == -1 %}x{% endif %}{% endfor %}{% endfor %}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def post(router, path: str, body, timeout: float = 120) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(router.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def peak_rss_mb(router) -> float:
    """The router process's peak resident memory (VmHWM) so far."""
    with open(f"/proc/{router.proc.pid}/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def health_latency(router) -> float:
    started = time.monotonic()
    with urllib.request.urlopen(router.url + "/health", timeout=30) as resp:
        assert resp.status == 200
    return time.monotonic() - started


def error_param(status_body: tuple[int, dict], status: int = 400):
    code, body = status_body
    assert code == status, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]["param"]


@pytest.fixture(scope="module")
def max_token_chars(tiny_llama) -> int:
    return load_tokenizer_assets(tiny_llama).max_token_chars


# ---- bad input: 400 naming the field ---------------------------------------------------------------------

BAD_BODIES = [
    ("surrogate_prompt", rb'{"model": "tiny", "prompt": "a\ud800b", "max_tokens": 2}', "prompt"),
    ("surrogate_message", rb'{"model": "tiny", "messages": [{"role": "user", "content": "\udc00"}]}',
     "messages[0].content"),
    ("surrogate_stop", rb'{"model": "tiny", "prompt": "x", "stop": ["\ud800"]}', "stop[0]"),
    ("nan_temperature", b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "temperature"),
    ("infinite_temperature", b'{"model": "tiny", "prompt": "x", "temperature": Infinity}', "temperature"),
    ("overflowing_temperature", b'{"model": "tiny", "prompt": "x", "temperature": 1e999}', "temperature"),
    ("nan_top_p", b'{"model": "tiny", "prompt": "x", "top_p": NaN}', "top_p"),
    ("nan_min_p", b'{"model": "tiny", "prompt": "x", "min_p": NaN}', "min_p"),
    ("infinite_penalty", b'{"model": "tiny", "prompt": "x", "presence_penalty": -Infinity}', "presence_penalty"),
    ("nan_repetition_penalty", b'{"model": "tiny", "prompt": "x", "repetition_penalty": NaN}',
     "repetition_penalty"),
    ("nan_logit_bias", b'{"model": "tiny", "prompt": "x", "logit_bias": {"5": NaN}}', "logit_bias.5"),
    ("nan_seed", b'{"model": "tiny", "prompt": "x", "seed": NaN}', "seed"),
    ("superscript_key", '{"model": "tiny", "prompt": "x", "logit_bias": {"\u00b2": 1}}'.encode(), "logit_bias"),
    ("arabic_digit_key", '{"model": "tiny", "prompt": "x", "logit_bias": {"\u0661": 1}}'.encode(), "logit_bias"),
    ("negative_key", b'{"model": "tiny", "prompt": "x", "logit_bias": {"-1": 1}}', "logit_bias"),
    ("spaced_key", b'{"model": "tiny", "prompt": "x", "logit_bias": {" 5": 1}}', "logit_bias"),
]


@pytest.mark.parametrize("name,raw,field", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_input_is_400_naming_the_field(router, name, raw, field):
    path = "/v1/chat/completions" if b'"messages"' in raw else "/v1/completions"
    assert error_param(post(router, path, raw)) == field


@pytest.mark.parametrize("depth", [65, 1000, 200_000])
def test_deeply_nested_json_is_400(router, depth):
    raw = b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    code, body = post(router, "/v1/completions", raw)
    assert code == 400 and "nested deeper than 64" in body["error"]["message"], body


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "frequency_penalty", "repetition_penalty"])
def test_grpc_api_refuses_non_finite_floats_naming_the_field(router, field):
    """The router's gRPC API takes floats straight from protobuf, where NaN and Infinity are representable."""
    import grpc

    from tandem.common.proto_gen.tandem import router_pb2 as rpb
    from tandem.common.proto_gen.tandem import router_pb2_grpc as rpb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
        for value in (float("nan"), float("inf")):
            request = rpb.GenerateRequest(model="tiny", text="x", sampling_params=rpb.SamplingParams(
                max_tokens=2, **{field: value}))
            with pytest.raises(grpc.RpcError) as info:
                list(rpb_grpc.RouterStub(channel).Generate(request, timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith(field), info.value.details()


def test_the_router_still_serves_after_bad_input(router):
    assert post(router, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 2})[0] == 200


# ---- a prompt that cannot fit: refused by its length in characters, before tokenizing -------------------------

def test_the_character_bound_is_the_longest_token_times_the_context(router, max_token_chars):
    bound = CONTEXT * max_token_chars
    code, body = post(router, "/v1/completions", {"model": "tiny", "prompt": "a" * (bound + 1)})
    assert code == 400 and body["error"]["param"] == "prompt"
    assert f"{bound + 1} characters" in body["error"]["message"], body
    # At the bound the prompt is tokenized, and then its token count refuses it.
    code, body = post(router, "/v1/completions", {"model": "tiny", "prompt": "a" * bound})
    assert code == 400 and body["error"]["param"] == "prompt" and "tokens" in body["error"]["message"], body
    assert "characters" not in body["error"]["message"]


def test_a_multi_megabyte_prompt_is_refused_without_tokenizing_it(router):
    """Tokenizing costs the router hundreds of bytes a character (over a gigabyte for these 6 MB); refusing by
    length holds little more than the body."""
    prompt = "The little cat sat on the mat. " * (6 * 1024 * 1024 // 31)
    before = peak_rss_mb(router)
    started = time.monotonic()
    completion = post(router, "/v1/completions", {"model": "tiny", "prompt": prompt})
    chat = post(router, "/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]})
    elapsed = time.monotonic() - started
    assert error_param(completion) == "prompt" and "characters" in completion[1]["error"]["message"]
    assert error_param(chat) == "messages" and "characters" in chat[1]["error"]["message"]
    growth = peak_rss_mb(router) - before
    assert growth < 300, f"the router's peak memory grew {growth:.0f} MB: was the prompt tokenized?"
    assert elapsed < 30, f"two refusals took {elapsed:.1f} s"


# ---- the body limit ------------------------------------------------------------------------------------------

def test_a_body_over_the_limit_is_413_with_an_openai_error(router):
    """The default limit is derived from the context (4 bytes a character of the longest prompt that fits),
    at least 8 MiB: for the tiny model, the floor."""
    raw = b'{"model": "tiny", "prompt": "' + b"a" * MIN_REQUEST_BODY_BYTES + b'"}'
    code, body = post(router, "/v1/completions", raw)
    assert error_param((code, body), 413) is None and body["error"]["code"] == "request_too_large"
    assert str(MIN_REQUEST_BODY_BYTES) in body["error"]["message"]


def test_a_chunked_body_over_the_limit_is_413(router):
    """No Content-Length: the router counts as it reads and stops at the limit."""
    chunk = b"a" * (1024 * 1024)
    chunks = [b'{"model": "tiny", "prompt": "'] + [chunk] * 9 + [b'"}']
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=60)
    try:
        try:
            conn.request("POST", "/v1/completions", body=iter(chunks), encode_chunked=True,
                         headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
        except (BrokenPipeError, ConnectionResetError):
            pass  # the router answered and closed before the client finished sending
        resp = conn.getresponse()
        assert resp.status == 413
        assert json.loads(resp.read())["error"]["code"] == "request_too_large"
    finally:
        conn.close()


# ---- /health while a prompt is processed (off the event loop) ------------------------------------------------

@pytest.fixture(scope="module")
def slow_prompt_router(worker_address, tiny_llama, tmp_path_factory):
    """A router whose tokenizer has one 4,100-character token (so multi-megabyte prompts pass the character
    bound and get tokenized) and a chat template that takes seconds for a first message "slow"."""
    from tokenizers import AddedToken, Tokenizer

    model_dir = str(tmp_path_factory.mktemp("slow-tokenizer"))
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(tiny_llama, name)):
            shutil.copy(os.path.join(tiny_llama, name), model_dir)
    tokenizer = Tokenizer.from_file(os.path.join(tiny_llama, "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(LONG_TOKEN, special=False)])
    tokenizer.save(os.path.join(model_dir, "tokenizer.json"))
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["chat_template"] = SLOW_TEMPLATE
    with open(config_path, "w") as f:
        json.dump(config, f)
    proc = RouterProcess("--worker", f"grpc://{worker_address}", "--model-path", model_dir,
                         "--served-model-name", "tiny", "--max-request-body-bytes", str(64 * 1024 * 1024))
    wait_until(lambda: readiness(proc) == 200, 60, "router readiness")
    yield proc
    assert proc.stop() == 0, "router did not shut down cleanly:\n" + "".join(proc.log[-40:])


def _health_while(router, body: dict, path: str) -> tuple[list[float], tuple[int, dict], bool]:
    """Post `body` on a thread; sample /health latency while it runs. Returns the latencies, the reply, and
    whether the request was still in flight after the last sample (so the samples overlapped it)."""
    reply: list = []
    thread = threading.Thread(target=lambda: reply.append(post(router, path, body)), daemon=True)
    thread.start()
    time.sleep(0.2)  # the body is sent and being processed
    latencies = [health_latency(router) for _ in range(5)]
    overlapped = thread.is_alive()
    thread.join(120)
    assert reply, "the request did not finish"
    return latencies, reply[0], overlapped


def test_health_answers_while_a_long_prompt_is_tokenized(slow_prompt_router):
    prompt = "The little cat sat on the mat, and the dog barked at it. " * (1536 * 1024 // 58)  # seconds
    latencies, reply, overlapped = _health_while(slow_prompt_router, {"model": "tiny", "prompt": prompt},
                                                 "/v1/completions")
    assert max(latencies) < 1.0, f"/health took {max(latencies):.2f} s while a prompt was tokenized"
    assert overlapped, "the prompt was tokenized before /health was asked: make it longer"
    # It was tokenized (within the character bound), then refused by its token count.
    assert error_param(reply) == "prompt" and "tokens" in reply[1]["error"]["message"], reply


def test_health_answers_while_a_chat_template_renders(slow_prompt_router):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "slow"}], "max_completion_tokens": 2}
    latencies, reply, overlapped = _health_while(slow_prompt_router, body, "/v1/chat/completions")
    assert max(latencies) < 1.0, f"/health took {max(latencies):.2f} s while a chat template rendered"
    assert overlapped, "the template rendered before /health was asked: make it slower"
    assert reply[0] == 200, reply
