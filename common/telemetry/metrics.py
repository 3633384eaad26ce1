"""Every Prometheus metric Tandem exports (all named tandem_*), grouped per service, each on a per-process
CollectorRegistry that is passed around (never the global one), so several services can share a test process.

Per-event figures (latencies, token counts, transfers) are observed where they happen; queue sizes, KV pool
usage, cache hit rate and the scheduler's own counters are read at scrape time by SchedulerStatsCollector
from one `stats()` call, so the scheduler loop does no metrics work per step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.common.roles import Role

logger = logging.getLogger(__name__)

# ---- buckets: LLM latencies span milliseconds (a decode step) to minutes (a long generation) ----------------
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0,
               180.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = tuple(float(2 ** i) for i in range(18))  # 1 .. 131072 tokens
# Expert imbalance (max / mean tokens per expert-parallel rank): 1 is balanced, ep_size all on one rank.
IMBALANCE_BUCKETS = (1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0, 64.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# The bench tool (common/bench/metrics.py) reads these two by name; Prometheus appends _total to counters.
PREFIX_CACHE_HIT_TOKENS = "tandem_prefix_cache_hit_tokens"
PREFIX_CACHE_QUERY_TOKENS = "tandem_prefix_cache_query_tokens"
PREFIX_CACHE_HIT_HELP = "Prompt tokens served from a prefix cache instead of being computed"
PREFIX_CACHE_QUERY_HELP = "Prompt tokens looked up in a prefix cache"
BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}


def new_registry() -> CollectorRegistry:
    """A fresh registry for one service in this process."""
    return CollectorRegistry(auto_describe=True)


MODEL_NAME_LABEL = "model_name"


class ModelNameLabel(Collector):
    """`inner`'s metrics with a model_name label on every sample, as vLLM's and SGLang's carry, so dashboards and
    alerts tell models (and releases serving different models) apart. The name is read at scrape time: the
    router learns it from its workers."""

    def __init__(self, inner: CollectorRegistry, model_name: Callable[[], str]):
        self.inner = inner
        self.model_name = model_name

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        name = self.model_name()
        for family in self.inner.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [s._replace(labels={**s.labels, MODEL_NAME_LABEL: name}) for s in family.samples]
            yield labelled


def with_model_name(registry: CollectorRegistry, model_name: Callable[[], str]) -> CollectorRegistry:
    """A registry that serves `registry` with the model_name label (what /metrics exposes)."""
    exposed = CollectorRegistry(auto_describe=False)
    exposed.register(ModelNameLabel(registry, model_name))
    return exposed


def render(registry: CollectorRegistry) -> bytes:
    """Prometheus text exposition of a registry (for an existing HTTP server's /metrics route)."""
    return generate_latest(registry)


def _check_role(role: str) -> str:
    try:
        return Role(role).value
    except ValueError:
        raise ValueError(f"role must be one of {', '.join(r.value for r in Role)}, got {role!r}") from None


class _NoopMetric:
    """Stands in for a metric (and its labelled children) when a component runs with metrics off."""

    def labels(self, *values, **labels) -> "_NoopMetric":
        return self

    def inc(self, amount: float = 1.0) -> None:
        pass

    def observe(self, value: float) -> None:
        pass

    def set(self, value: float) -> None:
        pass


NOOP_METRIC = _NoopMetric()
# `reason` of tandem_router_migrations_total: what failed under a request that then moved to another worker.
MIGRATION_REASONS = ("unavailable", "aborted", "health", "transfer", "error")


def _metric(kind, registry: Optional[CollectorRegistry], *args, **kwargs):
    """A Counter/Histogram/Gauge on `registry`, or the do-nothing metric when metrics are off (registry None)."""
    return NOOP_METRIC if registry is None else kind(*args, registry=registry, **kwargs)


# ---- common engine: per-request latencies and sizes (label role) ---------------------------------------------

class RequestMetrics:
    """Client-visible request figures, observed by whoever streams a request's tokens (router handler or
    worker servicer), labelled with that process's role. `registry` None: metrics off (every metric a no-op)."""

    def __init__(self, registry: Optional[CollectorRegistry], role: str):
        self.role = _check_role(role)
        r, labels = registry, ["role"]
        self.ttft = _metric(Histogram, r, "tandem_time_to_first_token_seconds", "Time from receiving a request to "
                            "sending its first output token", labels, buckets=TTFT_BUCKETS).labels(role)
        self.itl = _metric(Histogram, r, "tandem_inter_token_latency_seconds", "Time between consecutive output "
                           "tokens of one sequence", labels, buckets=ITL_BUCKETS).labels(role)
        self.e2e = _metric(Histogram, r, "tandem_e2e_request_latency_seconds", "Time from receiving a request to its "
                           "last output token", labels, buckets=E2E_BUCKETS).labels(role)
        self.queue_time = _metric(Histogram, r, "tandem_request_queue_time_seconds", "Time a request waited before "
                                  "being admitted (router: admission slot; worker: scheduler queues)", labels,
                                  buckets=QUEUE_BUCKETS).labels(role)
        self.prompt_tokens = _metric(Histogram, r, "tandem_request_prompt_tokens", "Prompt length of finished "
                                     "requests, in tokens", labels, buckets=TOKEN_BUCKETS).labels(role)
        self.generation_tokens = _metric(Histogram, r, "tandem_request_generation_tokens", "Output length of "
                                         "finished requests, in tokens", labels, buckets=TOKEN_BUCKETS).labels(role)
        self._finished = _metric(Counter, r, "tandem_requests_finished", "Requests finished, by finish reason "
                                 "(stop, length, abort, error)", ["role", "reason"])

    def finished(self, reason: str) -> None:
        self._finished.labels(self.role, reason or "unknown").inc()

    def start(self, received: Optional[float] = None) -> "RequestTimer":
        """A timer for one request; `received` is its time.monotonic() arrival (default now)."""
        return RequestTimer(self, received)


class RequestTimer:
    """One request's clock, kept by the code that streams it: tokens() per streamed chunk, finish() once."""

    __slots__ = ("metrics", "received", "last_token", "admitted_at", "_done")

    def __init__(self, metrics: RequestMetrics, received: Optional[float] = None):
        self.metrics = metrics
        self.received = time.monotonic() if received is None else received
        self.last_token: Optional[float] = None
        self.admitted_at: Optional[float] = None
        self._done = False

    def admitted(self) -> None:
        """The request left the queue (observes the queue time once)."""
        if self.admitted_at is None:
            self.admitted_at = time.monotonic()
            self.metrics.queue_time.observe(self.admitted_at - self.received)

    def tokens(self, n: int) -> None:
        """`n` output tokens went out now: the first observes TTFT, later ones the inter-token gap (split
        evenly over the tokens of one chunk)."""
        if n <= 0:
            return
        now = time.monotonic()
        if self.last_token is None:
            self.metrics.ttft.observe(now - self.received)
            n -= 1
        if n > 0 and self.last_token is not None:
            gap = (now - self.last_token) / n
            for _ in range(n):
                self.metrics.itl.observe(gap)
        self.last_token = now

    def finish(self, reason: str, prompt_tokens: int, generation_tokens: int) -> None:
        if self._done:
            return
        self._done = True
        m = self.metrics
        m.e2e.observe(time.monotonic() - self.received)
        m.prompt_tokens.observe(prompt_tokens)
        m.generation_tokens.observe(generation_tokens)
        m.finished(reason)


# ---- KV transfer (prefill and decode) --------------------------------------------------------------------------

class TransferMetrics:
    def __init__(self, registry: Optional[CollectorRegistry], role: str):
        self.role = _check_role(role)
        r, labels = registry, ["role"]
        self.bytes = _metric(Counter, r, "tandem_kv_transfer_bytes", "KV cache bytes moved between prefill and "
                             "decode", labels).labels(role)
        self.pages = _metric(Counter, r, "tandem_kv_transfer_pages", "KV cache pages moved between prefill and "
                             "decode", labels).labels(role)
        self.latency = _metric(Histogram, r, "tandem_kv_transfer_duration_seconds", "Time from a request's first KV "
                               "WRITE to the decode holding its whole prompt KV", labels,
                               buckets=TRANSFER_BUCKETS).labels(role)
        self._failures = _metric(Counter, r, "tandem_kv_transfer_failures", "KV transfers that failed or were "
                                 "aborted, by failure kind", ["role", "reason"])

    def done(self, nbytes: int, pages: int, seconds: float) -> None:
        """One request's transfer completed."""
        self.bytes.inc(nbytes)
        self.pages.inc(pages)
        self.latency.observe(seconds)

    def failed(self, label: str) -> None:
        """`label`: the failure kind's metric label (common/transfer/failures.py) — never a message."""
        self._failures.labels(self.role, label).inc()


# ---- prefill / decode specifics (their schedulers create them on the worker's registry) ------------------------

class PrefillMetrics:
    def __init__(self, registry: Optional[CollectorRegistry]):
        r = registry
        self.bootstrap_wait = _metric(Histogram, r, "tandem_prefill_bootstrap_wait_seconds", "Time a prefill leg "
                                      "waited for its decode to reserve KV pages (bootstrap queue)",
                                      buckets=QUEUE_BUCKETS)
        self.chunks = _metric(Counter, r, "tandem_prefill_chunks", "Prefill chunks computed (chunked prefill)")
        self.transfer = TransferMetrics(r, Role.PREFILL)


class DecodeMetrics:
    def __init__(self, registry: Optional[CollectorRegistry]):
        r = registry
        self.prealloc_wait = _metric(Histogram, r, "tandem_decode_prealloc_wait_seconds", "Time a decode leg waited "
                                     "for KV pages (prealloc queue, admission control)", buckets=QUEUE_BUCKETS)
        self.prebuilt = _metric(Counter, r, "tandem_decode_prebuilt_requests", "Decode legs that joined the running "
                                "batch with transferred KV (no forward pass)")
        self.local_prefill = _metric(Counter, r, "tandem_decode_local_prefill_requests", "Requests this decode "
                                     "worker prefilled itself (sent without a prefill worker)")
        self.transfer = TransferMetrics(r, Role.DECODE)


class HiCacheMetrics:
    """HiCache's tiers (docs/hicache.md): hit tokens per tier, load-back latency, bytes per tier and direction,
    L2/L3 occupancy, labelled with the worker's role. `registry` None: metrics off."""

    def __init__(self, registry: Optional[CollectorRegistry], role: str = "unified"):
        r = registry
        self._hit_tokens = _metric(Counter, r, "tandem_hicache_hit_tokens", "Prompt tokens reused from each cache "
                                   "tier (device, host, disk) by admitted requests", ["role", "tier"])
        self.load_back_seconds = _metric(Histogram, r, "tandem_hicache_load_back_seconds", "Time to load one "
                                         "match's host and disk pages onto the device", ["role"],
                                         buckets=QUEUE_BUCKETS).labels(role)
        self._bytes = _metric(Counter, r, "tandem_hicache_bytes", "KV bytes written to / read from the host and "
                              "disk tiers", ["role", "tier", "direction"])
        self.host_tokens = _metric(Gauge, r, "tandem_hicache_host_tokens", "Tokens held in the host pool (L2)",
                                   ["role"]).labels(role)
        self.storage_bytes = _metric(Gauge, r, "tandem_hicache_storage_bytes", "Bytes held in storage (L3)",
                                     ["role"]).labels(role)
        self.role = role

    def hit_tokens(self, tier: str, tokens: int) -> None:
        self._hit_tokens.labels(self.role, tier).inc(tokens)

    def moved_bytes(self, tier: str, direction: str, nbytes: int) -> None:
        self._bytes.labels(self.role, tier, direction).inc(nbytes)


# ---- scheduler state, read at scrape time ----------------------------------------------------------------------

@dataclass
class SchedulerStats:
    """One consistent reading of a scheduler (taken on its own thread): what the gauges show."""

    queues: dict[str, int] = field(default_factory=dict)  # running, waiting, chunked, prealloc, transfer, ...
    kv_total_tokens: int = 0
    kv_used_tokens: int = 0  # held by requests or the prefix cache
    kv_cached_tokens: int = 0  # held only by the prefix cache (evictable)
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    retractions: int = 0
    aborts: int = 0
    sessions_open: int = 0  # sessions with KV pinned here
    session_pinned_tokens: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_used_tokens / self.kv_total_tokens if self.kv_total_tokens else 0.0

    @property
    def cache_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


def read_scheduler_stats(scheduler) -> SchedulerStats:
    """Run on the scheduler thread, e.g. `engine.call(read_scheduler_stats, 2.0)`: a Scheduler's queues,
    KV pool and prefix cache counters."""
    ops = scheduler.ops
    tree = ops.tree_cache
    total = ops.allocator.size
    evictable = tree.evictable_size() if ops.caching else 0
    return SchedulerStats(
        queues=dict(scheduler.queue_sizes()), kv_total_tokens=total,
        kv_used_tokens=total - ops.allocator.available_size(), kv_cached_tokens=evictable,
        prefix_hit_tokens=getattr(tree, "hit_tokens", 0), prefix_query_tokens=getattr(tree, "queried_tokens", 0),
        retractions=scheduler.outputs.counters.num_retractions, aborts=scheduler.outputs.counters.num_aborts,
        **_session_stats(scheduler))


def _session_stats(scheduler) -> dict:
    sessions = getattr(scheduler, "sessions", None)  # test stand-ins may have none
    if sessions is None:
        return {}
    return {"sessions_open": len(sessions), "session_pinned_tokens": sessions.pinned_tokens()}


class SchedulerStatsCollector(Collector):
    """Gauges and counters from `stats()` at scrape time; a failing or slow stats() (a wedged scheduler)
    leaves them out of that scrape rather than failing /metrics."""

    def __init__(self, stats: Callable[[], SchedulerStats], role: str):
        self.stats = stats
        self.role = _check_role(role)

    def describe(self) -> Iterable:
        return []  # families are built per scrape; nothing to check up front

    def collect(self) -> Iterable:
        try:
            s = self.stats()
        except Exception as e:  # noqa: BLE001 - the other metrics must still be served
            logger.warning("scheduler stats unavailable for /metrics: %r", e)
            return
        role = [self.role]
        queues = GaugeMetricFamily("tandem_scheduler_queue_requests", "Requests in each scheduler queue (running, "
                                   "waiting, chunked; prefill: bootstrap, inflight; decode: prealloc, transfer, "
                                   "quarantine)", labels=["role", "queue"])
        for name, size in sorted(s.queues.items()):
            queues.add_metric([self.role, name], size)
        yield queues
        yield _gauge("tandem_kv_pool_usage_ratio", "Fraction of the KV pool in use (requests plus prefix cache)",
                     role, s.kv_usage)
        yield _gauge("tandem_kv_pool_used_tokens", "KV pool tokens in use (requests plus prefix cache)", role,
                     s.kv_used_tokens)
        yield _gauge("tandem_kv_pool_cached_tokens", "KV pool tokens held only by the prefix cache (evictable)",
                     role, s.kv_cached_tokens)
        yield _gauge("tandem_kv_pool_total_tokens", "KV pool capacity in tokens", role, s.kv_total_tokens)
        yield _gauge("tandem_radix_cache_hit_rate", "Prefix cache hit tokens / query tokens since start", role,
                     s.cache_hit_rate)
        yield _counter(PREFIX_CACHE_HIT_TOKENS, PREFIX_CACHE_HIT_HELP, role, s.prefix_hit_tokens)
        yield _counter(PREFIX_CACHE_QUERY_TOKENS, PREFIX_CACHE_QUERY_HELP, role, s.prefix_query_tokens)
        yield _counter("tandem_retractions", "Requests sent back to the waiting queue because KV ran out", role,
                       s.retractions)
        yield _counter("tandem_aborts", "Requests aborted in the scheduler (client, transfer failure, KV "
                       "exhausted)", role, s.aborts)
        yield _gauge("tandem_sessions_open", "Sessions whose turns keep KV pinned on this worker", role,
                     s.sessions_open)
        yield _gauge("tandem_session_pinned_tokens", "KV tokens that sessions keep pinned in the prefix cache", role,
                     s.session_pinned_tokens)


def _gauge(name: str, help_text: str, role: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text, labels=["role"])
    family.add_metric(role, value)
    return family


def _counter(name: str, help_text: str, role: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_text, labels=["role"])
    family.add_metric(role, value)
    return family


class WorkerMetrics:
    """A worker's request metrics and scheduler gauges on one registry; `WorkerMetrics.off(role)` observes nothing
    (the offline engine, tests). A role's own metrics (PrefillMetrics, DecodeMetrics) go on the same `registry`."""

    def __init__(self, role: str, registry: Optional[CollectorRegistry] = None):
        self.role = _check_role(role)
        self.registry: Optional[CollectorRegistry] = registry if registry is not None else new_registry()
        self.requests = RequestMetrics(self.registry, role)
        self.hicache = HiCacheMetrics(self.registry, self.role)
        self.expert_imbalance = _metric(Histogram, self.registry, "tandem_expert_imbalance", "Per MoE layer and "
                                        "forward pass while the expert-distribution recorder records: max / mean "
                                        "tokens per expert-parallel rank (1: balanced)", ["role", "layer"],
                                        buckets=IMBALANCE_BUCKETS)

    @classmethod
    def off(cls, role: str) -> "WorkerMetrics":
        metrics = cls.__new__(cls)
        metrics.role, metrics.registry = _check_role(role), None
        metrics.requests = RequestMetrics(None, role)
        metrics.expert_imbalance = NOOP_METRIC
        metrics.hicache = HiCacheMetrics(None, metrics.role)
        return metrics

    def imbalance_observer(self, moe_layers: Sequence[int]) -> Optional[Callable[[list[float]], None]]:
        """The expert recorder's on_imbalance: one observation per MoE layer, labelled with the model's layer index
        (`moe_layers`: the sparse layers, in the recorder's order); None with metrics off (nothing to feed, and the
        recorder then skips reading each pass's counts back)."""
        if self.registry is None or not moe_layers:
            return None
        children = [self.expert_imbalance.labels(self.role, str(layer)) for layer in moe_layers]

        def observe(per_layer: list[float]) -> None:
            for child, value in zip(children, per_layer):
                child.observe(value)
        return observe

    def exposition(self, model_name: str) -> CollectorRegistry:
        """What the worker's /metrics serves: its registry with model_name on every sample."""
        return with_model_name(self.registry if self.registry is not None else new_registry(), lambda: model_name)

    def watch_scheduler(self, stats: Callable[[], SchedulerStats]) -> None:
        """Serve the scheduler gauges from `stats()` at each scrape (call once)."""
        if self.registry is not None:
            self.registry.register(SchedulerStatsCollector(stats, self.role))

    def render(self) -> bytes:
        return generate_latest(self.registry) if self.registry is not None else b""


# ---- router ----------------------------------------------------------------------------------------------------

@dataclass
class WorkerSample:
    """One worker as the router sees it at scrape time."""

    address: str
    role: str
    healthy: bool  # passes health checks and its breaker lets requests through
    in_flight: int
    load: int  # running + waiting the worker last reported
    cached_blocks: int
    breaker_state: str  # closed | half_open | open
    kv_total_tokens: int = 0  # the worker's KV pool as last reported (0: not reported, or not a KV holder)
    kv_free_tokens: Optional[int] = None  # what admission counts as free (None: unknown)
    kv_reserved_tokens: int = 0  # reserved by this router's requests in flight there


class RouterWorkerCollector(Collector):
    def __init__(self, workers: Callable[[], Iterable[WorkerSample]]):
        self.workers = workers

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        labels = ["worker", "role"]
        healthy = GaugeMetricFamily("tandem_router_worker_healthy", "1 when the worker passes health checks and "
                                    "its circuit breaker lets requests through", labels=labels)
        in_flight = GaugeMetricFamily("tandem_router_worker_in_flight_requests", "Requests this router has in "
                                      "flight on the worker", labels=labels)
        load = GaugeMetricFamily("tandem_router_worker_load_requests", "Running + waiting requests the worker "
                                 "last reported", labels=labels)
        blocks = GaugeMetricFamily("tandem_router_worker_cached_blocks", "KV blocks the worker reports cached",
                                   labels=labels)
        breaker = GaugeMetricFamily("tandem_router_circuit_breaker_state", "Circuit breaker per worker: 0 closed, "
                                    "1 half-open, 2 open", labels=labels)
        kv_total = GaugeMetricFamily("tandem_router_worker_kv_total_tokens", "KV pool tokens the worker last "
                                     "reported (GetLoads)", labels=labels)
        kv_free = GaugeMetricFamily("tandem_router_worker_kv_free_tokens", "KV tokens admission counts as free on "
                                    "the worker (its report less this router's reservations not in it yet)",
                                    labels=labels)
        kv_reserved = GaugeMetricFamily("tandem_router_worker_kv_reserved_tokens", "KV tokens reserved by this "
                                        "router's requests in flight on the worker (prompt + max_tokens)",
                                        labels=labels)
        for w in self.workers():
            key = [w.address, w.role]
            healthy.add_metric(key, 1.0 if w.healthy else 0.0)
            in_flight.add_metric(key, w.in_flight)
            load.add_metric(key, w.load)
            blocks.add_metric(key, w.cached_blocks)
            breaker.add_metric(key, BREAKER_STATES.get(w.breaker_state, 2))
            if w.kv_total_tokens:
                kv_total.add_metric(key, w.kv_total_tokens)
                kv_free.add_metric(key, w.kv_free_tokens if w.kv_free_tokens is not None else w.kv_total_tokens)
                kv_reserved.add_metric(key, w.kv_reserved_tokens)
        yield from (healthy, in_flight, load, blocks, breaker, kv_total, kv_free, kv_reserved)


class RouterMetrics:
    """The router's metrics; attribute names match services/router/metrics.py's so it can replace it."""

    def __init__(self, registry: Optional[CollectorRegistry] = None, enabled: bool = True):
        """`enabled=False`: metrics off, every metric a no-op (a router part built alone, e.g. in a test)."""
        self.registry = r = (registry if registry is not None else new_registry()) if enabled else None
        self.request = RequestMetrics(r, "router")
        self.http_requests = _metric(Counter, r, "tandem_router_http_requests", "HTTP requests answered, by route "
                                     "and status", ["route", "status"])
        self.http_latency = _metric(Histogram, r, "tandem_router_http_request_duration_seconds", "HTTP request "
                                    "handling time (streaming responses: until the last byte)", ["route"],
                                    buckets=E2E_BUCKETS)
        self.worker_requests = _metric(Counter, r, "tandem_router_worker_requests", "Requests (legs) sent to each "
                                       "worker, retries included", ["worker", "role"])
        self.retries = _metric(Counter, r, "tandem_router_retries", "Attempts repeated on another worker (pair)")
        self.migrations = _metric(Counter, r, "tandem_router_migrations", "Requests moved to another worker (pair) "
                                  "after tokens reached the client, by what failed: unavailable, aborted, health, "
                                  "transfer or error", ["reason"])
        for reason in MIGRATION_REASONS:  # every reason's series from the start, at 0
            self.migrations.labels(reason)
        self.disagg_decisions = _metric(Counter, r, "tandem_router_disagg_decisions", "Attempts sent to a "
                                        "prefill/decode pair (decision=pair) or prefilled on the decode "
                                        "(decision=local), by --disagg-policy reason", ["decision", "reason"])
        self.prompt_tokens = _metric(Counter, r, "tandem_router_prompt_tokens", "Prompt tokens served")
        self.generation_tokens = _metric(Counter, r, "tandem_router_generation_tokens", "Output tokens served")
        self.running = _metric(Gauge, r, "tandem_router_running_requests", "Requests admitted and not yet ended")
        self.queued = _metric(Gauge, r, "tandem_router_queued_requests", "Requests waiting in the router's queue "
                              "for KV capacity or a running slot")
        self.new_token_ratio = _metric(Gauge, r, "tandem_router_admission_new_token_ratio", "Share of max_tokens "
                                       "admission reserves per sequence (learned; 1 under --admission-reserve full)")
        self.rejected = _metric(Counter, r, "tandem_router_queue_rejections", "Requests answered 429 by admission: "
                                "reason queue_full (--max-queued-requests) or queue_timeout (--queue-timeout-s)",
                                ["reason"])
        self.model_name: Callable[[], str] = lambda: "unknown"
        # Labelled role="router" like the workers' series of the same names, so sums never mix the two.
        self.cache_hit_tokens = _metric(Counter, r, PREFIX_CACHE_HIT_TOKENS, PREFIX_CACHE_HIT_HELP
                                        + " (responses' cached_tokens, all workers)", ["role"]).labels("router")
        self.cache_query_tokens = _metric(Counter, r, PREFIX_CACHE_QUERY_TOKENS, PREFIX_CACHE_QUERY_HELP
                                          + " (responses' prompt_tokens, all workers)", ["role"]).labels("router")

    def watch(self, workers: Callable[[], Iterable[WorkerSample]], running: Callable[[], float],
              queued: Callable[[], float], model_name: Optional[Callable[[], str]] = None) -> None:
        """Read per-worker gauges, the admission queue and the served model's name at scrape time (call once)."""
        if self.registry is None:
            return
        self.model_name = model_name or self.model_name
        self.registry.register(RouterWorkerCollector(workers))
        self.running.set_function(running)
        self.queued.set_function(queued)

    def observe_usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        """A finished request's usage, as its response reports it."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.cache_hit_tokens.inc(cached_tokens)
        self.cache_query_tokens.inc(prompt_tokens)

    def sent_to(self, worker: str, role: str) -> None:
        self.worker_requests.labels(worker, role).inc()

    def render(self) -> bytes:
        """/metrics: every sample with the model_name label."""
        if self.registry is None:
            return b""
        return generate_latest(with_model_name(self.registry, self.model_name))
