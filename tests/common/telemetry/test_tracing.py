"""Tracing: spans reach a real OTLP receiver with the right names, attributes and parents across a router →
worker hop; nothing is recorded or sent when tracing is off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from opentelemetry import trace

from tandem.common.telemetry import propagation, tracing
from tests.common.telemetry.trace_scenarios import CLIENT_SPAN_ID, CLIENT_TRACE_ID

REPO = Path(__file__).resolve().parents[3]
SERVER, INTERNAL = 2, 1  # OTLP span kinds
_OTEL_VARS = [k for k in os.environ if k.startswith("OTEL_")]


def run_scenario(role: str, env: dict[str, str], metadata: list | None = None) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    args = [sys.executable, "-m", "tests.common.telemetry.trace_scenarios", role]
    if metadata is not None:
        args.append(json.dumps(metadata))
    proc = subprocess.run(args, cwd=REPO, env={**base, **env}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def by_name(spans) -> dict:
    return {s.name: s for s in spans}


@pytest.mark.e2e
def test_router_to_workers_hop_links_spans_into_one_trace(otlp_receiver):
    router = run_scenario("router", otlp_receiver.env("tandem-router"))
    assert router["enabled"] and router["trace_id"] == CLIENT_TRACE_ID
    keys = [k for k, _ in router["metadata"]]
    assert keys[0] == "authorization" and "traceparent" in keys  # caller's metadata kept, context appended
    run_scenario("prefill", otlp_receiver.env("tandem-prefill"), router["metadata"])
    run_scenario("decode", otlp_receiver.env("tandem-decode"), router["metadata"])
    want = {tracing.ROUTER_REQUEST, tracing.ROUTER_TOKENIZE, tracing.ROUTER_ROUTE, "tandem.prefill.request",
            tracing.BOOTSTRAP_WAIT, tracing.QUEUE_WAIT, tracing.PREFILL_FORWARD, tracing.KV_TRANSFER,
            "tandem.decode.request", tracing.PREALLOC_WAIT, tracing.FIRST_TOKEN, tracing.STREAM_END}
    spans = otlp_receiver.wait_for(lambda got: want <= {s.name for s in got}
                                   and len([s for s in got if s.name == tracing.KV_TRANSFER]) == 2)
    assert {s.trace_id for s in spans} == {CLIENT_TRACE_ID}

    router_spans = by_name(s for s in spans if s.service == "tandem-router")
    request = router_spans[tracing.ROUTER_REQUEST]
    assert request.parent_span_id == CLIENT_SPAN_ID and request.kind == SERVER
    assert request.attributes["gen_ai.system"] == "tandem"
    assert request.attributes["gen_ai.request.model"] == "tiny"
    assert request.attributes["gen_ai.request.max_tokens"] == 8
    assert request.attributes["gen_ai.request.temperature"] == 0.5
    assert request.attributes["gen_ai.usage.output_tokens"] == 3
    assert request.attributes["gen_ai.response.finish_reasons"] == ["stop"]
    assert [e[0] for e in request.events] == ["first_token"]
    assert router_spans[tracing.ROUTER_TOKENIZE].parent_span_id == request.span_id
    route = router_spans[tracing.ROUTER_ROUTE]
    assert route.parent_span_id == request.span_id
    assert route.attributes == {"tandem.policy": "cache_aware", "tandem.prefill.worker": "10.0.0.1:30000",
                                "tandem.decode.worker": "10.0.0.2:30000", "tandem.room": 42}

    prefill = [s for s in spans if s.service == "tandem-prefill"]
    p_root = by_name(prefill)["tandem.prefill.request"]
    assert p_root.parent_span_id == request.span_id and p_root.kind == SERVER
    assert p_root.attributes["tandem.room"] == 42 and p_root.attributes["gen_ai.usage.input_tokens"] == 12
    for s in prefill:
        if s is not p_root:
            assert s.parent_span_id == p_root.span_id, s.name
            assert p_root.start_ns <= s.start_ns <= s.end_ns <= p_root.end_ns, s.name
    p = by_name(prefill)
    assert p[tracing.QUEUE_WAIT].start_ns == p[tracing.BOOTSTRAP_WAIT].end_ns  # queue wait starts at bootstrap end
    forward = p[tracing.PREFILL_FORWARD]
    assert [(e[0], e[2]) for e in forward.events] == [("chunk", {"tandem.chunk.tokens": 8}),
                                                      ("chunk", {"tandem.chunk.tokens": 4})]
    transfer = p[tracing.KV_TRANSFER]
    assert transfer.attributes["tandem.kv.bytes"] == 4096 and transfer.attributes["tandem.kv.pages"] == 3
    assert transfer.attributes["tandem.kv.seconds"] >= 0.01

    decode = by_name(s for s in spans if s.service == "tandem-decode")
    d_root = decode["tandem.decode.request"]
    assert d_root.parent_span_id == request.span_id
    assert d_root.attributes["tandem.cached_tokens"] == 4
    assert d_root.attributes["gen_ai.usage.output_tokens"] == 3  # the second finish() changed nothing
    stream = decode[tracing.STREAM_END]
    assert stream.attributes["gen_ai.response.finish_reasons"] == ["stop"]
    assert stream.start_ns == decode[tracing.FIRST_TOKEN].end_ns and stream.end_ns == d_root.end_ns
    assert abs(decode[tracing.KV_TRANSFER].attributes["tandem.kv.seconds"] - 0.005) < 1e-6


@pytest.mark.e2e
def test_real_grpc_call_carries_the_context(otlp_receiver):
    out = run_scenario("grpc_hop", otlp_receiver.env("tandem-hop"))
    spans = by_name(otlp_receiver.wait_for_names({tracing.ROUTER_REQUEST, "tandem.decode.request"}))
    router, worker = spans[tracing.ROUTER_REQUEST], spans["tandem.decode.request"]
    assert router.parent_span_id == "" and router.trace_id == out["trace_id"]
    assert worker.trace_id == router.trace_id and worker.parent_span_id == router.span_id
    assert worker.attributes["gen_ai.response.finish_reasons"] == ["length"]


@pytest.mark.e2e
def test_aiohttp_router_returns_trace_id_on_streamed_and_error_replies(otlp_receiver):
    out = run_scenario("http_router", otlp_receiver.env("tandem-router"))
    assert out["/v1/stream"] == [200, CLIENT_TRACE_ID]
    assert out["/v1/bad"] == [400, CLIENT_TRACE_ID]
    assert out["/health"] == [400, None]  # outside /v1: not traced
    spans = otlp_receiver.wait_for(lambda got: len([s for s in got if s.name == tracing.ROUTER_REQUEST]) == 2)
    requests = {s.attributes["url.path"]: s for s in spans if s.name == tracing.ROUTER_REQUEST}
    assert requests["/v1/bad"].attributes["http.response.status_code"] == 400
    assert all(s.parent_span_id == CLIENT_SPAN_ID for s in requests.values())
    tokenize = by_name(spans)[tracing.ROUTER_TOKENIZE]
    assert tokenize.parent_span_id == requests["/v1/stream"].span_id


@pytest.mark.e2e
def test_http_protobuf_protocol_and_service_name_override(otlp_receiver):
    env = otlp_receiver.env("custom-name", protocol="http/protobuf")
    assert run_scenario("unified", env)["enabled"]
    spans = otlp_receiver.wait_for_names({"tandem.unified.request", tracing.QUEUE_WAIT, tracing.PREFILL_FORWARD,
                                          tracing.STREAM_END})
    assert {s.service for s in spans} == {"custom-name"}
    root = by_name(spans)["tandem.unified.request"]
    assert root.parent_span_id == ""  # no caller context: a root span


@pytest.mark.e2e
def test_sampler_from_environment_drops_spans(otlp_receiver):
    out = run_scenario("router", {**otlp_receiver.env("tandem-router"), "OTEL_TRACES_SAMPLER": "always_off"})
    assert out["enabled"] and out["trace_id"] == CLIENT_TRACE_ID  # the id still names the (unsampled) trace
    traceparent = dict(out["metadata"])["traceparent"]
    assert traceparent.endswith("-00")  # not sampled: parent-based workers do not sample it either
    run_scenario("decode", {**otlp_receiver.env("tandem-decode")}, out["metadata"])
    time.sleep(0.5)
    assert otlp_receiver.spans() == []


@pytest.mark.e2e
def test_sdk_disabled_sends_nothing_and_records_nothing(otlp_receiver):
    env = {**otlp_receiver.env("tandem-router"), "OTEL_SDK_DISABLED": "true"}
    out = run_scenario("router", env)
    assert out == {"metadata": [["authorization", "Bearer x"]], "trace_id": None, "enabled": False,
                   "tracing_enabled": False}
    assert run_scenario("decode", env, out["metadata"])["recording"] is False
    time.sleep(0.5)
    assert otlp_receiver.spans() == []


def test_off_without_endpoint_every_helper_is_a_no_op(monkeypatch):
    for key in _OTEL_VARS:
        monkeypatch.delenv(key)
    assert tracing.setup_tracing("tandem-test") is False and not tracing.tracing_enabled()
    headers = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    assert propagation.extract_http(headers) is None
    assert propagation.extract_grpc(list(headers.items())) is None
    assert propagation.inject_grpc(None) is None
    meta = [("a", "b")]
    assert propagation.inject_grpc(meta) is meta
    with tracing.router_request_span() as span:
        assert span is trace.INVALID_SPAN and not span.is_recording()
        tracing.set_route(span, prefill="p", decode="d", room=1)
        assert propagation.current_trace_id() is None
    trace_ = tracing.start_request_trace("decode", list(headers.items()), model="m")
    assert trace_ is tracing.NOOP_TRACE and not trace_.recording
    trace_.mark("first_token"), trace_.chunk(3), trace_.transfer(1, 1, 0.1), trace_.finish(1, "stop")


def test_unknown_protocol_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    with pytest.raises(ValueError, match="http/json"):
        tracing.setup_tracing("tandem-test")
    assert not tracing.tracing_enabled()


def test_request_trace_rejects_unknown_role():
    with pytest.raises(ValueError, match="role"):
        tracing.RequestTrace("router", None, {})
