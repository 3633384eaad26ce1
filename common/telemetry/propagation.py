"""W3C trace context across process hops: extract from HTTP headers and gRPC metadata, inject into gRPC metadata."""

from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter

from tandem.common.telemetry import tracing

TRACEPARENT = "traceparent"
TRACE_ID_HEADER = "x-trace-id"  # the router's response header naming the request's trace


class _LowerDictGetter(Getter[dict]):
    """Reads a dict whose keys were lower-cased; HTTP/2 (gRPC) keys are lower-case on the wire anyway."""

    def get(self, carrier: dict, key: str) -> Optional[list[str]]:
        value = carrier.get(key.lower())
        return None if value is None else [value]

    def keys(self, carrier: dict) -> list[str]:
        return list(carrier)


_GETTER = _LowerDictGetter()


def _lowered(pairs: Iterable[tuple[str, object]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in pairs:
        if isinstance(value, bytes):  # binary gRPC metadata ("-bin" keys) carries no trace context
            continue
        out.setdefault(key.lower(), str(value))
    return out


def extract_http(headers: Optional[Mapping[str, str]]) -> Optional[Context]:
    """The parent context named by an HTTP request's `traceparent`/`tracestate` headers (aiohttp's
    CIMultiDictProxy or any mapping); None when tracing is off or no header came."""
    if not tracing.tracing_enabled() or not headers:
        return None
    carrier = _lowered(headers.items())
    if TRACEPARENT not in carrier:
        return None
    return propagate.extract(carrier, getter=_GETTER)


def extract_grpc(metadata: Optional[Sequence[tuple[str, object]]]) -> Optional[Context]:
    """The parent context from gRPC invocation metadata (`context.invocation_metadata()` on the server);
    None when tracing is off or the caller sent no trace context."""
    if not tracing.tracing_enabled() or not metadata:
        return None
    carrier = _lowered((m[0], m[1]) for m in metadata)
    if TRACEPARENT not in carrier:
        return None
    return propagate.extract(carrier, getter=_GETTER)


def inject_grpc(metadata: Optional[list[tuple[str, str]]] = None,
                context: Optional[Context] = None) -> Optional[list[tuple[str, str]]]:
    """Outgoing gRPC metadata carrying the current (or given) span's context, as a list of tuples for the
    stub's `metadata=` argument. Returns `metadata` untouched when tracing is off (None stays None)."""
    if not tracing.tracing_enabled():
        return metadata
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    if not carrier:
        return metadata
    out = list(metadata or [])
    out.extend((key.lower(), value) for key, value in carrier.items())
    return out


def trace_id_metadata() -> list[tuple[str, str]]:
    """[("x-trace-id", id)] naming the current trace (for gRPC initial metadata), or [] when there is none."""
    trace_id = current_trace_id()
    return [(TRACE_ID_HEADER, trace_id)] if trace_id else []


def aiohttp_tracing(app, path_prefix: str = "/v1") -> None:
    """Trace an aiohttp app's requests under `path_prefix`: a router request span per request (child of the
    client's traceparent) that is current while the handler runs, and an `x-trace-id` response header, on
    streamed and error responses too. Install it before other middlewares so it wraps them."""
    from aiohttp import web  # aiohttp (~0.15 s): the workers import this module and never serve HTTP

    key = "tandem_trace_id"

    @web.middleware
    async def trace_requests(request, handler):
        if not tracing.tracing_enabled() or not request.path.startswith(path_prefix):
            return await handler(request)
        attrs = {"http.request.method": request.method, "url.path": request.path}
        with tracing.router_request_span(parent=extract_http(request.headers), attributes=attrs) as span:
            request[key] = current_trace_id()
            response = await handler(request)
            span.set_attribute("http.response.status_code", response.status)
            return response

    async def add_header(request, response) -> None:
        trace_id = request.get(key)
        if trace_id:
            response.headers[TRACE_ID_HEADER] = trace_id

    app.middlewares.insert(0, trace_requests)
    app.on_response_prepare.append(add_header)


def current_trace_id(context: Optional[Context] = None) -> Optional[str]:
    """The 32-hex-digit trace id of the current (or given) span, for the `x-trace-id` response header;
    None when tracing is off or no span is recording."""
    if not tracing.tracing_enabled():
        return None
    span_context = trace.get_current_span(context).get_span_context()
    if not span_context.is_valid:
        return None
    return trace.format_trace_id(span_context.trace_id)
