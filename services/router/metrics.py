"""The router's Prometheus metrics: common.telemetry's RouterMetrics, fed with this router's workers and queue."""

from __future__ import annotations

from typing import Callable

from tandem.common.telemetry.metrics import RouterMetrics, WorkerSample
from tandem.services.router.admission import Admission
from tandem.services.router.workers import WorkerRegistry


def worker_samples(registry: WorkerRegistry) -> list[WorkerSample]:
    """Every known worker as /metrics shows it (read at scrape time: workers come and go with DNS)."""
    return [WorkerSample(address=w.endpoint.address, role=w.role, healthy=w.available(), in_flight=w.in_flight,
                         load=w.load.running + w.load.waiting, cached_blocks=len(w.kv_index.blocks),
                         breaker_state=w.breaker.state, kv_total_tokens=w.kv.total, kv_free_tokens=w.kv.free(),
                         kv_reserved_tokens=w.kv.reserved)
            for w in list(registry.workers.values())]


def router_metrics(registry: WorkerRegistry, admission: Admission, model_name: Callable[[], str]
                   ) -> RouterMetrics:
    """The metrics; admission's 429s are counted by reason (admission.on_reject)."""
    metrics = RouterMetrics()
    metrics.watch(lambda: worker_samples(registry), lambda: admission.running, lambda: admission.waiting,
                  model_name)
    admission.on_reject = lambda reason: metrics.rejected.labels(reason).inc()
    if metrics.registry is not None:
        metrics.new_token_ratio.set_function(lambda: admission.ratio.value if admission.ratio is not None else 1.0)
    return metrics
