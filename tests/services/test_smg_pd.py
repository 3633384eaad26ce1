"""The real SGLang model gateway (`smg launch --pd-disaggregation`) driving a Tandem prefill and decode worker."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error

import jinja2
import pytest

from common.config import EngineConfig
from common.engine import Engine
from common.tokenizer import load_tokenizer
from tests.common.rpc.helpers import engine_greedy, free_port, http_get_json, http_post
from tests.services.pd_helpers import PDPair

pytestmark = pytest.mark.skipif(shutil.which("smg") is None,
                                reason="the smg gateway (pip install smg) is not installed")


def _sse_pieces(raw: bytes) -> list[dict]:
    events = raw.decode().split("\n\n")
    return [json.loads(e[len("data: "):]) for e in events if e.startswith("data: {")]


@pytest.fixture(scope="module")
def ref_engine(tiny_llama):
    """The in-process engine with the PD workers' configuration (tests.services.pd_helpers.PD_FLAGS)."""
    config = EngineConfig(model_path=tiny_llama, max_total_tokens=4096, page_size=4, chunked_prefill_size=48,
                          max_context_len=1024)
    with Engine(config) as engine:
        yield engine


@pytest.fixture(scope="module")
def gateway(tiny_llama, tmp_path_factory):
    pair = PDPair(tiny_llama)
    port = free_port()
    log = open(tmp_path_factory.mktemp("smg-pd") / "smg.log", "w+")
    smg = subprocess.Popen(["smg", "launch", "--pd-disaggregation",
                            "--prefill", f"grpc://{pair.prefill.address}", str(pair.prefill.bootstrap_port),
                            "--decode", f"grpc://{pair.decode.address}", "--model-path", tiny_llama,
                            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn",
                            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                           stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                workers = http_get_json(f"{base}/workers").get("workers", [])
                if len([w for w in workers if w.get("is_healthy")]) >= 2:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            if time.monotonic() > deadline or smg.poll() is not None:
                log.seek(0)
                pytest.fail("smg did not register both workers:\n" + log.read()[-3000:])
            time.sleep(0.25)
        yield base, pair
    finally:
        smg.terminate()
        smg.wait(30)
        log.close()
        pair.close()


def test_completions_through_smg_pd_equal_the_engine(gateway, tiny_llama, ref_engine):
    base, pair = gateway
    tokenizer = load_tokenizer(tiny_llama).tokenizer
    prompt = "the quick brown fox"
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids  # smg adds no special tokens to prompts
    expected = engine_greedy(ref_engine, ids, 10).sequences[0].output_ids
    body = {"model": os.path.basename(tiny_llama), "prompt": prompt, "max_tokens": 10, "temperature": 0}
    out = json.loads(http_post(f"{base}/v1/completions", body))
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == len(expected)
    assert out["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    pieces = _sse_pieces(http_post(f"{base}/v1/completions", {**body, "stream": True}))
    assert "".join(p["choices"][0]["text"] for p in pieces if p.get("choices")) == out["choices"][0]["text"]
    pair.wait_both_free()


def test_chat_completions_through_smg_pd_equal_the_engine(gateway, tiny_llama, ref_engine):
    base, pair = gateway
    info = load_tokenizer(tiny_llama)
    messages = [{"role": "user", "content": "tell me about the sea"}]
    text = jinja2.Template(info.chat_template).render(messages=messages, add_generation_prompt=True,
                                                      bos_token=info.bos_token)
    ids = info.tokenizer.encode(text, add_special_tokens=False).ids
    expected = info.tokenizer.decode(engine_greedy(ref_engine, ids, 8).sequences[0].output_ids,
                                     skip_special_tokens=True)
    body = {"model": os.path.basename(tiny_llama), "messages": messages, "max_tokens": 8, "temperature": 0}
    out = json.loads(http_post(f"{base}/v1/chat/completions", body))
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["choices"][0]["message"]["content"] == expected
    pieces = _sse_pieces(http_post(f"{base}/v1/chat/completions", {**body, "stream": True}))
    assert "".join(p["choices"][0]["delta"].get("content") or "" for p in pieces if p.get("choices")) == expected
    pair.wait_both_free()
