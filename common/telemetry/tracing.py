"""OpenTelemetry tracing for Tandem: opt-in set-up from the standard OTEL_* variables, the router's request
spans, and RequestTrace, a worker request's timeline that becomes spans when the request ends.

Off by default. When off, every helper here returns a shared no-op object and records nothing, so hot
code needs no guards (it may still test `tracing_enabled()` to skip building arguments).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Optional, Sequence

from opentelemetry import trace
from opentelemetry.context import Context

from tandem.common.roles import Role

logger = logging.getLogger(__name__)

TRACER_NAME = "tandem"
GEN_AI_SYSTEM = "tandem"
PROTOCOLS = ("grpc", "http/protobuf")

# Span names: one place, so dashboards, tests and docs agree.
ROUTER_REQUEST = "tandem.router.request"
ROUTER_TOKENIZE = "tandem.router.tokenize"
ROUTER_ROUTE = "tandem.router.route"
WORKER_REQUEST = "tandem.{role}.request"  # role: prefill | decode | unified
BOOTSTRAP_WAIT = "tandem.prefill.bootstrap_wait"
QUEUE_WAIT = "tandem.prefill.queue_wait"
PREFILL_FORWARD = "tandem.prefill.forward"
KV_TRANSFER = "tandem.kv.transfer"
PREALLOC_WAIT = "tandem.decode.prealloc_wait"
FIRST_TOKEN = "tandem.decode.first_token"
STREAM_END = "tandem.decode.stream"

# Attribute keys: GenAI semantic conventions where they exist, tandem.* for the rest.
ATTR_SYSTEM = "gen_ai.system"
ATTR_OPERATION = "gen_ai.operation.name"
ATTR_MODEL = "gen_ai.request.model"
ATTR_MAX_TOKENS = "gen_ai.request.max_tokens"
ATTR_TEMPERATURE = "gen_ai.request.temperature"
ATTR_INPUT_TOKENS = "gen_ai.usage.input_tokens"
ATTR_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
ATTR_FINISH_REASONS = "gen_ai.response.finish_reasons"
ATTR_REQUEST_ID = "tandem.request_id"
ATTR_ROOM = "tandem.room"
ATTR_PREFILL_WORKER = "tandem.prefill.worker"
ATTR_PREFILL_MODE = "tandem.prefill.mode"  # a decode's request: "remote" (KV from a prefill) or "local"
ATTR_DISAGG_DECISION = "tandem.disagg.decision"  # the router's choice: "pair" or "local"
ATTR_DISAGG_REASON = "tandem.disagg.reason"
ATTR_DECODE_WORKER = "tandem.decode.worker"
ATTR_POLICY = "tandem.policy"
ATTR_WORKER = "tandem.worker"  # a unified worker (no prefill/decode pair)
ATTR_KV_BYTES = "tandem.kv.bytes"
ATTR_KV_PAGES = "tandem.kv.pages"
ATTR_KV_SECONDS = "tandem.kv.seconds"
ATTR_CACHED_TOKENS = "tandem.cached_tokens"
ATTR_CHUNK_TOKENS = "tandem.chunk.tokens"
ATTR_ERROR = "tandem.error"

_enabled = False
_provider = None  # the SDK TracerProvider this module installed
_lock = threading.Lock()


def tracing_enabled() -> bool:
    """Whether setup_tracing() installed an exporter in this process (a plain module-level flag)."""
    return _enabled


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def _make_exporter(protocol: str):
    # The exporters read their endpoint, headers, TLS and timeout from the same OTEL_* variables.
    # optional (0.1 s or so each): imported only when OTEL_* turns tracing on, and only the protocol's own
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()


def setup_tracing(service_name: str) -> bool:
    """Install a TracerProvider exporting over OTLP when the environment asks for tracing: an endpoint in
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, and OTEL_SDK_DISABLED not true.
    OTEL_SERVICE_NAME overrides `service_name`; OTEL_TRACES_SAMPLER(_ARG) choose sampling; the protocol is
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL (grpc by default, or http/protobuf).
    Returns whether tracing is on; raises ValueError for an unsupported protocol."""
    global _enabled, _provider
    with _lock:
        if _provider is not None:  # the global TracerProvider can be set once per process
            return _enabled
        if _env("OTEL_SDK_DISABLED").lower() == "true":
            return False
        if not (_env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or _env("OTEL_EXPORTER_OTLP_ENDPOINT")):
            return False
        protocol = (_env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or _env("OTEL_EXPORTER_OTLP_PROTOCOL")
                    or "grpc").lower()
        if protocol not in PROTOCOLS:
            raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported; use one of "
                             f"{', '.join(PROTOCOLS)}")
        # optional: the SDK loads only when OTEL_* turns tracing on (off by default)
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        name = _env("OTEL_SERVICE_NAME") or service_name
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))  # sampler: from OTEL_TRACES_*
        provider.add_span_processor(BatchSpanProcessor(_make_exporter(protocol)))
        trace.set_tracer_provider(provider)
        _provider = provider
        _enabled = True
        logger.info("tracing on: service %s, OTLP over %s", name, protocol)
        return True


def shutdown_tracing(timeout_s: float = 5.0) -> None:
    """Flush queued spans and stop exporting; call once at process exit (after the servers stop)."""
    global _enabled
    with _lock:
        if _provider is None or not _enabled:
            return
        _enabled = False
        _provider.force_flush(int(timeout_s * 1000))
        _provider.shutdown()


def get_tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def request_attributes(model: Optional[str] = None, max_tokens: Optional[int] = None,
                       temperature: Optional[float] = None, request_id: Optional[str] = None,
                       room: Optional[int] = None) -> dict[str, Any]:
    """GenAI request attributes, leaving out what is unknown."""
    attrs: dict[str, Any] = {ATTR_SYSTEM: GEN_AI_SYSTEM}
    for key, value in ((ATTR_MODEL, model), (ATTR_MAX_TOKENS, max_tokens), (ATTR_TEMPERATURE, temperature),
                       (ATTR_REQUEST_ID, request_id), (ATTR_ROOM, room)):
        if value is not None:
            attrs[key] = value
    return attrs


def usage_attributes(input_tokens: Optional[int] = None, output_tokens: Optional[int] = None,
                     cached_tokens: Optional[int] = None,
                     finish_reasons: Optional[Sequence[str]] = None) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    for key, value in ((ATTR_INPUT_TOKENS, input_tokens), (ATTR_OUTPUT_TOKENS, output_tokens),
                       (ATTR_CACHED_TOKENS, cached_tokens)):
        if value is not None:
            attrs[key] = int(value)
    if finish_reasons:
        attrs[ATTR_FINISH_REASONS] = [str(r) for r in finish_reasons]
    return attrs


# ---- router: live spans (one asyncio task per request, so the current-span context flows) -------------------

@contextmanager
def router_request_span(name: str = ROUTER_REQUEST, parent: Optional[Context] = None,
                        attributes: Optional[Mapping[str, Any]] = None) -> Iterator[trace.Span]:
    """The router's root span for one client request (a child of `parent`, the client's traceparent, from
    propagation.extract_http / extract_grpc). Current for the block, so tokenize/route spans and the
    metadata injected into worker calls hang under it. Yields a no-op span when tracing is off."""
    if not _enabled:
        yield trace.INVALID_SPAN
        return
    attrs = {ATTR_SYSTEM: GEN_AI_SYSTEM, **(attributes or {})}
    with get_tracer().start_as_current_span(name, context=parent, kind=trace.SpanKind.SERVER,
                                            attributes=attrs) as span:
        yield span


@contextmanager
def router_tokenize_span() -> Iterator[trace.Span]:
    """Chat template + tokenization; the caller may set gen_ai.usage.input_tokens on the span."""
    if not _enabled:
        yield trace.INVALID_SPAN
        return
    with get_tracer().start_as_current_span(ROUTER_TOKENIZE) as span:
        yield span


@contextmanager
def router_route_span(policy: Optional[str] = None) -> Iterator[trace.Span]:
    """Picking the worker(s); record the choice with set_route() on the yielded span."""
    if not _enabled:
        yield trace.INVALID_SPAN
        return
    attrs = {ATTR_POLICY: policy} if policy else None
    with get_tracer().start_as_current_span(ROUTER_ROUTE, attributes=attrs) as span:
        yield span


def set_route(span: trace.Span, prefill: Optional[str] = None, decode: Optional[str] = None,
              room: Optional[int] = None, policy: Optional[str] = None, worker: Optional[str] = None,
              disagg: Optional[str] = None, disagg_reason: Optional[str] = None) -> None:
    """Record the routing decision (worker addresses, room, policy, and whether and why a prefill worker is
    used) on a span (no-op span: nothing)."""
    if not span.is_recording():
        return
    for key, value in ((ATTR_PREFILL_WORKER, prefill), (ATTR_DECODE_WORKER, decode), (ATTR_ROOM, room),
                       (ATTR_POLICY, policy), (ATTR_WORKER, worker), (ATTR_DISAGG_DECISION, disagg),
                       (ATTR_DISAGG_REASON, disagg_reason)):
        if value is not None:
            span.set_attribute(key, value)


def current_span() -> trace.Span:
    """The span current in this task/thread (the no-op span when none, or when tracing is off)."""
    return trace.get_current_span() if _enabled else trace.INVALID_SPAN


def set_attributes(span: trace.Span, attributes: Mapping[str, Any]) -> None:
    if span.is_recording():
        span.set_attributes(dict(attributes))


def add_event(span: trace.Span, name: str, attributes: Optional[Mapping[str, Any]] = None) -> None:
    """An event on a live span, e.g. "first_token" or "retry" on the router's request span."""
    if span.is_recording():
        span.add_event(name, dict(attributes or {}))


# ---- workers: a timeline recorded cheaply on the scheduler thread, emitted as spans at the end -------------

# (span name, start marks tried in order, end mark): one child span per phase whose marks were recorded.
_PHASES: dict[Role, tuple[tuple[str, tuple[str, ...], str], ...]] = {
    Role.PREFILL: ((BOOTSTRAP_WAIT, ("received",), "bootstrap_end"),
                (QUEUE_WAIT, ("bootstrap_end", "received"), "queue_wait_end"),
                (PREFILL_FORWARD, ("queue_wait_end",), "forward_end")),
    Role.DECODE: ((PREALLOC_WAIT, ("received",), "prealloc_end"),
               (FIRST_TOKEN, ("received",), "first_token"),
               (STREAM_END, ("first_token",), "end")),
    Role.UNIFIED: ((QUEUE_WAIT, ("received",), "queue_wait_end"),
                (PREFILL_FORWARD, ("queue_wait_end",), "forward_end"),
                (STREAM_END, ("first_token",), "end")),
}


class RequestTrace:
    """One worker request's timeline. Created in the gRPC handler (start_request_trace), carried with the
    request into the scheduler thread, which records marks, chunks and transfers (a dict store each);
    finish() — called once, from either thread — turns the timeline into spans with explicit times, so no
    span object crosses a thread and nothing at all happens for the no-op trace."""

    __slots__ = ("role", "parent", "attributes", "marks", "chunks", "transfers", "_finished")
    recording = True

    def __init__(self, role: str, parent: Optional[Context], attributes: Mapping[str, Any]):
        if role not in _PHASES:
            raise ValueError(f"role must be one of {', '.join(map(str, _PHASES))}, got {role!r}")
        self.role = str(role)
        self.parent = parent
        self.attributes = dict(attributes)
        self.marks: dict[str, int] = {"received": time.time_ns()}
        self.chunks: list[tuple[int, int]] = []  # (time ns, tokens)
        self.transfers: list[tuple[int, int, int, int]] = []  # (start ns, end ns, bytes, pages)
        self._finished = False

    def mark(self, name: str) -> None:
        """Record that a phase boundary happened now; the first mark of a name wins (retries keep the first).
        Names the phases use: bootstrap_end, queue_wait_end, forward_end, prealloc_end, first_token,
        transfer_start."""
        if name not in self.marks:  # called per output chunk for first_token: no clock read after the first
            self.marks[name] = time.time_ns()

    def chunk(self, n_tokens: int) -> None:
        """One prefill chunk of `n_tokens` tokens finished (an event on the forward span)."""
        self.chunks.append((time.time_ns(), int(n_tokens)))

    def transfer(self, nbytes: int, pages: int, seconds: Optional[float] = None) -> None:
        """A KV transfer that ended now: `seconds` long, or since mark("transfer_start") when None."""
        end = time.time_ns()
        if seconds is not None:
            start = end - int(seconds * 1e9)
        else:
            start = self.marks.get("transfer_start", end)
        self.transfers.append((start, end, int(nbytes), int(pages)))

    def set(self, key: str, value: Any) -> None:
        """An attribute of the request span (e.g. tandem.cached_tokens once known)."""
        if value is not None:
            self.attributes[key] = value

    def finish(self, output_tokens: Optional[int] = None, finish_reason: Optional[str] = None,
               error: Optional[str] = None, input_tokens: Optional[int] = None,
               cached_tokens: Optional[int] = None) -> None:
        """The request ended: emit its spans (once; later calls do nothing)."""
        if self._finished:
            return
        self._finished = True
        end = time.time_ns()
        self.marks.setdefault("end", end)
        self.attributes.update(usage_attributes(input_tokens, output_tokens, cached_tokens,
                                                [finish_reason] if finish_reason else None))
        try:
            self._emit(dict(self.marks), list(self.chunks), list(self.transfers), end, error)
        except Exception:  # noqa: BLE001 - tracing must never fail a request
            logger.exception("cannot emit the spans of a %s request", self.role)

    def _emit(self, marks: dict[str, int], chunks: list, transfers: list, end: int, error: Optional[str]) -> None:
        tracer = get_tracer()
        root = tracer.start_span(WORKER_REQUEST.format(role=self.role), context=self.parent,
                                 kind=trace.SpanKind.SERVER, attributes=self.attributes,
                                 start_time=marks["received"])
        if error:
            root.set_attribute(ATTR_ERROR, error)
            root.set_status(trace.Status(trace.StatusCode.ERROR, error))
        inside = trace.set_span_in_context(root)
        for name, starts, end_mark in _PHASES[self.role]:
            start = next((marks[s] for s in starts if s in marks), None)
            stop = marks.get(end_mark)
            if start is None or stop is None:
                continue
            span = tracer.start_span(name, context=inside, start_time=start)
            if name == PREFILL_FORWARD:
                for at, tokens in chunks:
                    span.add_event("chunk", {ATTR_CHUNK_TOKENS: tokens}, timestamp=at)
            if name == STREAM_END:
                span.set_attributes(usage_attributes(self.attributes.get(ATTR_INPUT_TOKENS),
                                                     self.attributes.get(ATTR_OUTPUT_TOKENS),
                                                     finish_reasons=self.attributes.get(ATTR_FINISH_REASONS)))
            span.end(end_time=max(stop, start))
        for start, stop, nbytes, pages in transfers:
            span = tracer.start_span(KV_TRANSFER, context=inside, start_time=start, attributes={
                ATTR_KV_BYTES: nbytes, ATTR_KV_PAGES: pages, ATTR_KV_SECONDS: (stop - start) / 1e9})
            span.end(end_time=stop)
        root.end(end_time=end)


class NoopRequestTrace:
    """What start_request_trace returns when tracing is off: every method does nothing."""

    __slots__ = ()
    recording = False
    role = ""

    def mark(self, name: str) -> None:
        pass

    def chunk(self, n_tokens: int) -> None:
        pass

    def transfer(self, nbytes: int, pages: int, seconds: Optional[float] = None) -> None:
        pass

    def set(self, key: str, value: Any) -> None:
        pass

    def finish(self, output_tokens: Optional[int] = None, finish_reason: Optional[str] = None,
               error: Optional[str] = None, input_tokens: Optional[int] = None,
               cached_tokens: Optional[int] = None) -> None:
        pass


NOOP_TRACE = NoopRequestTrace()


def start_request_trace(role: str, metadata: Optional[Sequence[tuple[str, object]]] = None,
                        **attributes: Any) -> RequestTrace | NoopRequestTrace:
    """A worker request's trace, a child of the caller's context in the gRPC invocation `metadata`.
    Keyword arguments are request_attributes() fields (model, max_tokens, temperature, request_id, room)
    or extra span attributes given by key through `attrs={...}`. NOOP_TRACE when tracing is off."""
    if not _enabled:
        return NOOP_TRACE
    from tandem.common.telemetry.propagation import extract_grpc  # import cycle: propagation imports this module

    extra = attributes.pop("attrs", None) or {}
    attrs = {**request_attributes(**attributes), **extra}
    return RequestTrace(role, extract_grpc(metadata), attrs)
