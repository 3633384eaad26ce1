"""An in-process OTLP trace receiver for tests: a real OTLP/gRPC TraceService (and an OTLP/HTTP /v1/traces
endpoint) on 127.0.0.1 collecting every exported span. Use the `otlp_receiver` fixture, or `OtlpReceiver()`
as a context manager; point a process at it with `receiver.env(service_name)`."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pb_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclass
class ReceivedSpan:
    name: str
    service: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)  # (name, time ns, attributes)
    status_code: int = 0  # 0 unset, 1 ok, 2 error


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attrs(kvs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def spans_of(request: pb.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    out = []
    for resource_spans in request.resource_spans:
        service = _attrs(resource_spans.resource.attributes).get("service.name", "")
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                out.append(ReceivedSpan(
                    name=s.name, service=service, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent_span_id=s.parent_span_id.hex(), kind=s.kind, start_ns=s.start_time_unix_nano,
                    end_ns=s.end_time_unix_nano, attributes=_attrs(s.attributes),
                    events=[(e.name, e.time_unix_nano, _attrs(e.attributes)) for e in s.events],
                    status_code=s.status.code))
    return out


class _TraceService(pb_grpc.TraceServiceServicer):
    def __init__(self, sink: Callable[[pb.ExportTraceServiceRequest], None]):
        self.sink = sink

    def Export(self, request, context):
        self.sink(request)
        return pb.ExportTraceServiceResponse()


class OtlpReceiver:
    """Collects spans sent over OTLP/gRPC (`grpc_endpoint`) or OTLP/HTTP protobuf (`http_endpoint`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.requests: list[pb.ExportTraceServiceRequest] = []
        self._spans: list[ReceivedSpan] = []
        self._grpc: Optional[grpc.Server] = None
        self._http: Optional[ThreadingHTTPServer] = None
        self.grpc_endpoint = self.http_endpoint = ""

    def _add(self, request: pb.ExportTraceServiceRequest) -> None:
        with self._cond:
            self.requests.append(request)
            self._spans.extend(spans_of(request))
            self._cond.notify_all()

    def start(self) -> "OtlpReceiver":
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_TraceServiceServicer_to_server(_TraceService(self._add), self._grpc)
        port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._grpc.start()
        self.grpc_endpoint = f"http://127.0.0.1:{port}"
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver._add(pb.ExportTraceServiceRequest.FromString(body))
                reply = pb.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        self.http_endpoint = f"http://127.0.0.1:{self._http.server_address[1]}"
        return self

    def stop(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(grace=None)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()

    def __enter__(self) -> "OtlpReceiver":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def env(self, service_name: Optional[str] = None, protocol: str = "grpc") -> dict[str, str]:
        """Environment variables that make a Tandem process (setup_tracing) export here, flushing quickly."""
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": self.grpc_endpoint if protocol == "grpc" else self.http_endpoint,
               "OTEL_EXPORTER_OTLP_PROTOCOL": protocol, "OTEL_BSP_SCHEDULE_DELAY": "100",
               "OTEL_TRACES_SAMPLER": "parentbased_always_on"}
        if service_name:
            env["OTEL_SERVICE_NAME"] = service_name
        return env

    def spans(self, name: Optional[str] = None) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self._spans if name is None or s.name == name]

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 15.0
                 ) -> list[ReceivedSpan]:
        """Block until predicate(all spans so far) holds; returns the spans, or fails the test on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({s.name for s in self._spans})
                    pytest.fail(f"OTLP receiver: condition not met in {timeout_s}s; spans so far: {names}")
                self._cond.wait(left)
            return list(self._spans)

    def wait_for_names(self, names: set[str], timeout_s: float = 15.0) -> list[ReceivedSpan]:
        return self.wait_for(lambda spans: names <= {s.name for s in spans}, timeout_s)


@pytest.fixture
def otlp_receiver():
    """A running OtlpReceiver, stopped after the test. Import this fixture into a test module or conftest."""
    with OtlpReceiver() as receiver:
        yield receiver
