"""The router's Prometheus metrics (tandem_router_*, plus the prefix-cache counters the bench tool reads)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from services.router.messages import Usage

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _WorkerCollector:
    """Worker gauges read from the registry at scrape time (workers come and go with DNS)."""

    def __init__(self, registry):
        self.registry = registry

    def collect(self):
        healthy = GaugeMetricFamily("tandem_router_worker_healthy", "1 when the worker passes health checks "
                                    "and its circuit breaker lets requests through", labels=["worker", "role"])
        in_flight = GaugeMetricFamily("tandem_router_worker_in_flight_requests", "requests this router has "
                                      "in flight on the worker", labels=["worker", "role"])
        load = GaugeMetricFamily("tandem_router_worker_load_requests", "running + waiting requests the worker "
                                 "last reported", labels=["worker", "role"])
        blocks = GaugeMetricFamily("tandem_router_worker_cached_blocks", "KV blocks the worker reports cached",
                                   labels=["worker", "role"])
        for w in list(self.registry.workers.values()):
            labels = [w.endpoint.address, w.role]
            healthy.add_metric(labels, 1.0 if w.available() else 0.0)
            in_flight.add_metric(labels, w.in_flight)
            load.add_metric(labels, w.load.running + w.load.waiting)
            blocks.add_metric(labels, len(w.kv_index.blocks))
        yield from (healthy, in_flight, load, blocks)


class RouterMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tandem_router_requests", "requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("tandem_router_request_duration_seconds", "request latency", ["endpoint"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("tandem_router_time_to_first_token_seconds", "time to the first streamed text",
                              ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("tandem_router_prompt_tokens", "prompt tokens served", registry=r)
        self.generation_tokens = Counter("tandem_router_generation_tokens", "tokens generated", registry=r)
        self.retries = Counter("tandem_router_retries", "attempts repeated on another worker (pair)", registry=r)
        self.running = Gauge("tandem_router_running_requests", "requests in flight at the workers", registry=r)
        self.queued = Gauge("tandem_router_queued_requests", "requests waiting for a running slot", registry=r)
        self.cache_hit_tokens = Counter("tandem_prefix_cache_hit_tokens", "prompt tokens served from a worker's "
                                        "prefix cache (responses' cached_tokens)", registry=r)
        self.cache_query_tokens = Counter("tandem_prefix_cache_query_tokens", "prompt tokens looked up in a "
                                          "prefix cache (responses' prompt_tokens)", registry=r)

    def watch(self, worker_registry, admission) -> None:
        self.registry.register(_WorkerCollector(worker_registry))
        self.running.set_function(lambda: admission.running)
        self.queued.set_function(lambda: admission.waiting)

    def observe_usage(self, usage: Usage) -> None:
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        self.cache_hit_tokens.inc(usage.cached_tokens)
        self.cache_query_tokens.inc(usage.prompt_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
