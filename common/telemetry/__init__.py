"""Tandem's observability: OpenTelemetry traces (opt-in via OTEL_* variables) and Prometheus metrics."""

from common.telemetry.metrics import (RequestMetrics, RouterMetrics, SchedulerStats, WorkerMetrics, WorkerSample,
                                      new_registry, read_scheduler_stats)
from common.telemetry.metrics_server import (add_metrics_args, maybe_start_metrics_server, metrics_port_from_args,
                                             start_metrics_server)
from common.telemetry.propagation import (TRACE_ID_HEADER, aiohttp_tracing, current_trace_id, extract_grpc,
                                          extract_http, inject_grpc, trace_id_metadata)
from common.telemetry.tracing import (NOOP_TRACE, RequestTrace, add_event, current_span, request_attributes,
                                      router_request_span, router_route_span, router_tokenize_span, set_attributes,
                                      set_route, setup_tracing, shutdown_tracing, start_request_trace,
                                      tracing_enabled, usage_attributes)

__all__ = [
    "NOOP_TRACE", "RequestMetrics", "RequestTrace", "RouterMetrics", "SchedulerStats", "TRACE_ID_HEADER",
    "WorkerMetrics", "WorkerSample", "add_event", "add_metrics_args", "aiohttp_tracing", "current_span",
    "current_trace_id", "extract_grpc", "extract_http", "inject_grpc", "maybe_start_metrics_server",
    "metrics_port_from_args", "new_registry", "read_scheduler_stats", "request_attributes", "router_request_span",
    "router_route_span", "router_tokenize_span", "set_attributes", "set_route", "setup_tracing",
    "shutdown_tracing", "start_metrics_server", "start_request_trace", "trace_id_metadata", "tracing_enabled",
    "usage_attributes",
]
