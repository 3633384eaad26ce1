"""The real SGLang model gateway (`smg launch --pd-disaggregation`) driving a Tandem prefill and decode worker."""

from __future__ import annotations

import json
import os
import shutil

import jinja2
import pytest

from tandem.common.tokenizer import load_tokenizer
from tests.common.rpc.helpers import WorkerProcess, engine_greedy, http_post, smg_gateway, sse_events
from tests.services.pd_helpers import PD_FLAGS, PDPair, pd_reference_engine

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(shutil.which("smg") is None,
                                                  reason="the smg gateway (pip install smg) is not installed")]


@pytest.fixture(scope="module")
def ref_engine(tiny_llama):
    with pd_reference_engine(tiny_llama) as engine:
        yield engine


@pytest.fixture(scope="module")
def workers(tiny_llama):
    """The PD pair of the module's gateway, and a decode at TP 2 that the last test pairs with the same prefill:
    the three load at once."""
    decode_tp2 = WorkerProcess(tiny_llama, "--tp-size", "2", "--num-threads", "1", "--dist-timeout", "20",
                               command="decode", flags=PD_FLAGS, wait=False)
    try:
        pair = PDPair(tiny_llama)
    except BaseException:
        decode_tp2.proc.kill()
        raise
    try:
        yield pair, decode_tp2
    finally:
        pair.close()
        assert decode_tp2.stop() == 0, "the TP-2 decode did not stop cleanly"


@pytest.fixture(scope="module")
def gateway(workers, tiny_llama, tmp_path_factory):
    pair, _ = workers
    with smg_gateway(pd_workers(pair), tiny_llama, tmp_path_factory.mktemp("smg-pd"), healthy=2) as base:
        yield base, pair


def pd_workers(pair: PDPair) -> list[str]:
    """smg's worker arguments for `pair`."""
    return ["--pd-disaggregation", "--prefill", f"grpc://{pair.prefill.address}", str(pair.prefill.bootstrap_port),
            "--decode", f"grpc://{pair.decode.address}"]


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
    pieces = sse_events(http_post(f"{base}/v1/completions", {**body, "stream": True}))
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
    pieces = sse_events(http_post(f"{base}/v1/chat/completions", {**body, "stream": True}))
    assert "".join(p["choices"][0]["delta"].get("content") or "" for p in pieces if p.get("choices")) == expected
    pair.wait_both_free()


def test_smg_pd_with_decode_at_tp2_equals_the_engine(workers, tiny_llama, ref_engine, tmp_path):
    """A gateway of its own drives the module's prefill (TP 1) and a decode at TP 2: the prefill WRITEs head slices
    into both decode ranks; the text equals the single-process engine's, and both workers' pools end free."""
    shared, decode_tp2 = workers
    pair = PDPair.of(shared.prefill, decode_tp2)
    try:
        with smg_gateway(pd_workers(pair), tiny_llama, tmp_path, healthy=2) as base:
            tokenizer = load_tokenizer(tiny_llama).tokenizer
            prompt = "the quick brown fox jumps over the lazy dog " * 4
            ids = tokenizer.encode(prompt, add_special_tokens=False).ids
            expected = engine_greedy(ref_engine, ids, 10).sequences[0].output_ids
            body = {"model": os.path.basename(tiny_llama), "prompt": prompt, "max_tokens": 10, "temperature": 0}
            out = json.loads(http_post(f"{base}/v1/completions", body))
            assert out["usage"]["completion_tokens"] == len(expected)
            # smg holds back the bytes of an unfinished UTF-8 character at the end of the text.
            assert out["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True).rstrip("\ufffd")
            pair.wait_both_free()
    finally:
        for ch in pair.channels:
            ch.close()


def test_smg_pd_on_an_moe_model_at_ep2_equals_the_engine(model_factory, tmp_path):
    """The gateway drives an MoE pair: prefill at --tp-size 2 --ep-size 2 (each rank half the experts), decode on
    one rank; the text equals the single-process engine's and both pools end free."""
    model = model_factory("qwen3_moe")
    pair = PDPair(model, prefill_extra=("--tp-size", "2", "--ep-size", "2", "--num-threads", "1",
                                        "--dist-timeout", "20"))
    try:
        with smg_gateway(pd_workers(pair), model, tmp_path, healthy=2) as base:
            tokenizer = load_tokenizer(model).tokenizer
            prompt = "the river and the mountain city " * 3
            ids = tokenizer.encode(prompt, add_special_tokens=False).ids
            with pd_reference_engine(model) as engine:
                expected = engine_greedy(engine, ids, 10).sequences[0].output_ids
            body = {"model": os.path.basename(model), "prompt": prompt, "max_tokens": 10, "temperature": 0}
            out = json.loads(http_post(f"{base}/v1/completions", body))
            assert out["usage"]["completion_tokens"] == len(expected)
            assert out["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True).rstrip("\ufffd")
            pair.wait_both_free()
    finally:
        pair.close()
