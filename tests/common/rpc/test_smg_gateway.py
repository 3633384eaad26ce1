"""The real SGLang model gateway (`smg launch`) in front of `tandem worker`: OpenAI HTTP in, same tokens out."""

from __future__ import annotations

import json
import os
import shutil

import jinja2
import pytest

from tandem.common.tokenizer import load_tokenizer
from tests.common.rpc.helpers import engine_greedy, http_post, smg_gateway, sse_events

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(shutil.which("smg") is None,
                                                  reason="the smg gateway (pip install smg) is not installed")]


@pytest.fixture(scope="module")
def gateway(worker, tiny_llama, tmp_path_factory):
    """smg in front of the package's worker (its clean stop is asserted where the package ends)."""
    with smg_gateway(["--worker-urls", f"grpc://{worker.address}"], tiny_llama, tmp_path_factory.mktemp("smg"),
                     healthy=1) as base:
        yield base


def test_completions_through_smg_equal_the_engine(gateway, tiny_llama, ref_engine):
    tokenizer = load_tokenizer(tiny_llama).tokenizer
    prompt = "the quick brown fox"
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids  # smg adds no special tokens to prompts
    expected = engine_greedy(ref_engine, ids, 10).sequences[0].output_ids
    body = {"model": os.path.basename(tiny_llama), "prompt": prompt, "max_tokens": 10, "temperature": 0}
    out = json.loads(http_post(f"{gateway}/v1/completions", body))
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 10
    assert out["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert out["choices"][0]["finish_reason"] == "length"
    pieces = sse_events(http_post(f"{gateway}/v1/completions", {**body, "stream": True}))
    assert "".join(p["choices"][0]["text"] for p in pieces) == out["choices"][0]["text"]


def test_chat_completions_through_smg_equal_the_engine(gateway, tiny_llama, ref_engine):
    info = load_tokenizer(tiny_llama)
    messages = [{"role": "user", "content": "tell me about the sea"}]
    text = jinja2.Template(info.chat_template).render(messages=messages, add_generation_prompt=True,
                                                      bos_token=info.bos_token)
    ids = info.tokenizer.encode(text, add_special_tokens=False).ids
    expected = engine_greedy(ref_engine, ids, 8).sequences[0].output_ids
    body = {"model": os.path.basename(tiny_llama), "messages": messages, "max_tokens": 8, "temperature": 0}
    out = json.loads(http_post(f"{gateway}/v1/chat/completions", body))
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["choices"][0]["message"]["content"] == info.tokenizer.decode(expected, skip_special_tokens=True)


def test_smg_applies_stop_strings_itself(gateway, tiny_llama, ref_engine):
    tokenizer = load_tokenizer(tiny_llama).tokenizer
    prompt = "the quick brown fox"
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    full = tokenizer.decode(engine_greedy(ref_engine, ids, 10).sequences[0].output_ids, skip_special_tokens=True)
    stop = full[3:6]  # usually spans a token boundary: smg cannot turn it into a stop token id
    body = {"model": os.path.basename(tiny_llama), "prompt": prompt, "max_tokens": 10, "temperature": 0,
            "stop": [stop]}
    out = json.loads(http_post(f"{gateway}/v1/completions", body))
    assert out["choices"][0]["text"] == full[:full.index(stop)]
    assert out["choices"][0]["finish_reason"] == "stop"
