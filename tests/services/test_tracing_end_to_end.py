"""One chat request through router → prefill → decode (real processes) becomes one trace: every service's
spans reach an OTLP receiver under the client's trace id, linked parent to child, with GenAI attributes."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

from tandem.common.telemetry import tracing as t
from tests.common.telemetry.otlp_receiver import OtlpReceiver
from tests.services.stack_helpers import PDStack

pytestmark = pytest.mark.e2e

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
MAX_TOKENS = 8
# Long enough for several prefill chunks (the workers run --chunked-prefill-size 48).
MESSAGES = [{"role": "user", "content": " ".join(f"word{i} of the sea and its tides" for i in range(20))}]
WANTED = {t.ROUTER_REQUEST, t.ROUTER_TOKENIZE, t.ROUTER_ROUTE, "tandem.prefill.request", t.BOOTSTRAP_WAIT,
          t.QUEUE_WAIT, t.PREFILL_FORWARD, t.KV_TRANSFER, "tandem.decode.request", t.PREALLOC_WAIT,
          t.FIRST_TOKEN, t.STREAM_END}


@pytest.fixture(scope="module")
def traced(tiny_llama):
    with OtlpReceiver() as receiver:
        stack = PDStack(tiny_llama, env=receiver.env())
        try:
            yield stack, receiver
        finally:
            stack.close()


def chat(stack: PDStack) -> tuple[dict, dict]:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(stack.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read()), dict(resp.headers)


def test_one_trace_covers_router_prefill_and_decode(traced, tiny_llama):
    stack, receiver = traced
    reply, headers = chat(stack)
    assert headers["x-trace-id"] == TRACE_ID
    spans = receiver.wait_for(lambda got: WANTED <= {s.name for s in got if s.trace_id == TRACE_ID}
                              and sum(s.name == t.KV_TRANSFER for s in got) >= 2, timeout_s=30)
    spans = [s for s in spans if s.trace_id == TRACE_ID]
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    one = {name: group[0] for name, group in by_name.items()}

    # The router: a request span under the client's span, tokenize and route spans under it.
    root = one[t.ROUTER_REQUEST]
    assert root.parent_span_id == CLIENT_SPAN_ID and root.service == "tandem-router"
    assert root.attributes[t.ATTR_SYSTEM] == "tandem" and root.attributes[t.ATTR_MODEL] == "tiny"
    assert root.attributes[t.ATTR_MAX_TOKENS] == MAX_TOKENS and root.attributes[t.ATTR_TEMPERATURE] == 0
    prompt_tokens = reply["usage"]["prompt_tokens"]
    assert prompt_tokens > 48 and root.attributes[t.ATTR_INPUT_TOKENS] == prompt_tokens
    assert one[t.ROUTER_TOKENIZE].parent_span_id == root.span_id
    assert one[t.ROUTER_TOKENIZE].attributes[t.ATTR_INPUT_TOKENS] == prompt_tokens
    route = one[t.ROUTER_ROUTE]
    assert route.parent_span_id == root.span_id
    assert route.attributes[t.ATTR_PREFILL_WORKER] == stack.pair.prefill.address
    assert route.attributes[t.ATTR_DECODE_WORKER] == stack.pair.decode.address
    room = route.attributes[t.ATTR_ROOM]

    # Both worker legs hang under the router's request span and carry the route's room.
    prefill, decode = one["tandem.prefill.request"], one["tandem.decode.request"]
    for leg, service in ((prefill, "tandem-prefill"), (decode, "tandem-decode")):
        assert leg.parent_span_id == root.span_id and leg.service == service
        assert leg.attributes[t.ATTR_ROOM] == room
        assert leg.attributes[t.ATTR_MODEL] == os.path.basename(tiny_llama)  # the worker's served name
        assert leg.attributes[t.ATTR_MAX_TOKENS] == MAX_TOKENS
        assert leg.attributes[t.ATTR_INPUT_TOKENS] == prompt_tokens
    assert decode.attributes[t.ATTR_PREFILL_WORKER] == f"127.0.0.1:{stack.pair.prefill.bootstrap_port}"

    # Prefill phases: bootstrap wait, queue wait, forward (one event per chunk), KV transfer.
    for name in (t.BOOTSTRAP_WAIT, t.QUEUE_WAIT, t.PREFILL_FORWARD):
        assert one[name].parent_span_id == prefill.span_id and one[name].service == "tandem-prefill"
    chunks = [e for e in one[t.PREFILL_FORWARD].events if e[0] == "chunk"]
    assert len(chunks) >= 2 and sum(e[2][t.ATTR_CHUNK_TOKENS] for e in chunks) == prompt_tokens
    assert one[t.QUEUE_WAIT].end_ns <= one[t.PREFILL_FORWARD].start_ns + 1
    pages = -(-prompt_tokens // 4)  # --page-size 4
    transfers = {s.service: s for s in by_name[t.KV_TRANSFER]}
    assert transfers["tandem-prefill"].parent_span_id == prefill.span_id
    assert transfers["tandem-decode"].parent_span_id == decode.span_id
    for span in transfers.values():
        assert span.attributes[t.ATTR_KV_PAGES] == pages and span.attributes[t.ATTR_KV_BYTES] > 0
    assert transfers["tandem-prefill"].attributes[t.ATTR_KV_BYTES] == \
        transfers["tandem-decode"].attributes[t.ATTR_KV_BYTES]

    # Decode phases: prealloc wait, first token, the stream with its output and finish reason.
    for name in (t.PREALLOC_WAIT, t.FIRST_TOKEN, t.STREAM_END):
        assert one[name].parent_span_id == decode.span_id and one[name].service == "tandem-decode"
    stream = one[t.STREAM_END]
    assert stream.attributes[t.ATTR_OUTPUT_TOKENS] == MAX_TOKENS == reply["usage"]["completion_tokens"]
    assert stream.attributes[t.ATTR_FINISH_REASONS] == ["length"]
    assert decode.attributes[t.ATTR_FINISH_REASONS] == ["length"]
    assert one[t.FIRST_TOKEN].end_ns <= stream.end_ns
    assert all(s.status_code != 2 for s in spans)


def test_grpc_api_continues_the_callers_trace(traced):
    import grpc

    from tandem.common.proto_gen.tandem import router_pb2 as rpb
    from tandem.common.proto_gen.tandem import router_pb2_grpc as rpb_grpc

    stack, receiver = traced
    trace_id, parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    with grpc.insecure_channel(f"127.0.0.1:{stack.router.grpc_port}") as channel:
        stream = rpb_grpc.RouterStub(channel).Chat(
            rpb.ChatRequest(model="tiny", messages=[rpb.ChatMessage(role="user", content="hello")],
                            sampling_params=rpb.SamplingParams(max_tokens=3, temperature=0)),
            metadata=[("traceparent", f"00-{trace_id}-{parent}-01")])
        responses = list(stream)
        assert dict(stream.initial_metadata())["x-trace-id"] == trace_id
    assert responses[-1].HasField("usage")
    spans = receiver.wait_for(lambda got: {t.ROUTER_REQUEST, "tandem.decode.request"} <=
                              {s.name for s in got if s.trace_id == trace_id}, timeout_s=30)
    (root,) = [s for s in spans if s.trace_id == trace_id and s.name == t.ROUTER_REQUEST]
    assert root.parent_span_id == parent
    (decode,) = [s for s in spans if s.trace_id == trace_id and s.name == "tandem.decode.request"]
    assert decode.parent_span_id == root.span_id
