"""The router's Prometheus metrics: common.telemetry's RouterMetrics, fed with this router's workers and queue."""

from __future__ import annotations

from common.telemetry.metrics import RouterMetrics, WorkerSample
from services.router.admission import Admission
from services.router.workers import WorkerRegistry


def worker_samples(registry: WorkerRegistry) -> list[WorkerSample]:
    """Every known worker as /metrics shows it (read at scrape time: workers come and go with DNS)."""
    return [WorkerSample(address=w.endpoint.address, role=w.role, healthy=w.available(), in_flight=w.in_flight,
                         load=w.load.running + w.load.waiting, cached_blocks=len(w.kv_index.blocks),
                         breaker_state=w.breaker.state)
            for w in list(registry.workers.values())]


def router_metrics(registry: WorkerRegistry, admission: Admission) -> RouterMetrics:
    metrics = RouterMetrics()
    metrics.watch(lambda: worker_samples(registry), lambda: admission.running, lambda: admission.waiting)
    return metrics
