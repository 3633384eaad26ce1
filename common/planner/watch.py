"""The planner's eyes and voice: scrape the router and the workers every interval, keep a window of scrapes,
decide, and export the decision as tandem_planner_* metrics (what an autoscaler reads)."""

from __future__ import annotations

import logging
import time
import urllib.error
import urllib.request
from collections import deque
from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge

from tandem.common.planner.config import PlannerConfig
from tandem.common.planner.decide import Decision, Planner
from tandem.common.planner.signals import Scrape, Signals, parse_router, parse_worker_queue, window

logger = logging.getLogger(__name__)
SCRAPE_TIMEOUT_S = 5.0


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as resp:
        return resp.read().decode()


class PlannerMetrics:
    def __init__(self, registry: Optional[CollectorRegistry] = None):
        self.registry = r = registry or CollectorRegistry()
        self.desired = Gauge("tandem_planner_desired_replicas", "Workers the planner says the load needs, per "
                             "role (an HPA's or KEDA's target: one replica per unit)", ["role"], registry=r)
        self.observed = Gauge("tandem_planner_observed_replicas", "Healthy workers the router reports, per role",
                              ["role"], registry=r)
        self.capacity = Gauge("tandem_planner_capacity_tokens_per_second", "Tokens/s one worker serves at "
                              "saturation, as measured (prefill: prompt tokens, decode: output tokens)", ["role"],
                              registry=r)
        self.decisions = Counter("tandem_planner_decisions", "Changes of the plan, by role, direction and reason",
                                 ["role", "direction", "reason"], registry=r)
        self.ttft = Gauge("tandem_planner_ttft_seconds", "The window's TTFT quantile (NaN: no request)",
                          registry=r)
        self.itl = Gauge("tandem_planner_itl_seconds", "The window's ITL quantile (NaN: no token)", registry=r)
        self.queue = Gauge("tandem_planner_queue_seconds", "The window's mean queue time before prefill",
                           registry=r)
        self.kv_usage = Gauge("tandem_planner_decode_kv_usage_ratio", "The window's mean decode KV usage",
                              registry=r)
        self.load = Gauge("tandem_planner_load_tokens_per_second", "The window's served tokens/s per role (prefill: "
                          "prompt, decode: output)", ["role"], registry=r)
        self.request_rate = Gauge("tandem_planner_request_rate", "The window's first tokens per second (requests "
                                  "started)", registry=r)
        self.scrape_errors = Counter("tandem_planner_scrape_errors", "Scrapes of the router or a worker that failed",
                                     registry=r)

    def record(self, s: Signals, decisions: dict[str, Decision], planner: Planner) -> None:
        nan = float("nan")
        self.ttft.set(nan if s.ttft_s is None else s.ttft_s)
        self.itl.set(nan if s.itl_s is None else s.itl_s)
        self.queue.set(s.queue_s)
        self.kv_usage.set(nan if s.kv_usage is None else s.kv_usage)
        self.load.labels("prefill").set(s.prompt_tps)
        self.load.labels("decode").set(s.generation_tps)
        self.request_rate.set(s.requests / s.seconds)
        for role, d in decisions.items():
            self.desired.labels(role).set(d.desired)
            self.observed.labels(role).set(s.replicas.get(role, 0))
            capacity = planner.roles[role].capacity.per_worker_tps
            self.capacity.labels(role).set(nan if capacity is None else capacity)
            if d.direction != "hold":
                self.decisions.labels(role, d.direction, d.reason).inc()


class Watcher:
    """Scrapes into a window and decides once per interval; `worker_metrics` may change between ticks (a
    launcher's workers come and go)."""

    def __init__(self, config: PlannerConfig, metrics: Optional[PlannerMetrics] = None,
                 worker_metrics: Optional[Callable[[], list[str]]] = None, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.planner = Planner(config)
        self.metrics = metrics or PlannerMetrics()
        self.worker_metrics = worker_metrics or (lambda: list(config.worker_metrics))
        self.clock = clock
        self.scrapes: deque[Scrape] = deque()
        self.last_signals: Optional[Signals] = None

    def scrape(self) -> Optional[Scrape]:
        at = self.clock()
        try:
            scrape = parse_router(fetch(self.config.router_url.rstrip("/") + "/metrics"), at)
        except (urllib.error.URLError, OSError, ValueError) as e:
            self.metrics.scrape_errors.inc()
            logger.warning("planner: cannot scrape the router at %s: %s", self.config.router_url, e)
            return None
        for url in self.worker_metrics():
            try:
                scrape.prefill_queue[url] = parse_worker_queue(fetch(url))
            except (urllib.error.URLError, OSError, ValueError) as e:
                self.metrics.scrape_errors.inc()
                logger.info("planner: cannot scrape %s: %s", url, e)
        return scrape

    def tick(self) -> Optional[dict[str, Decision]]:
        """Scrape and, once a window's worth is held, decide; None while the window fills or the router is
        unreachable (no decision on no data)."""
        scrape = self.scrape()
        if scrape is None:
            return None
        self.scrapes.append(scrape)
        while len(self.scrapes) > 2 and scrape.at - self.scrapes[1].at >= self.config.window_s:
            self.scrapes.popleft()
        first = self.scrapes[0]
        if scrape.at - first.at < self.config.window_s * 0.999:
            return None
        usages = [s.kv_usage for s in self.scrapes if s.kv_usage is not None]
        signals = window(first, scrape, self.config.slo_quantile, usages)
        decisions = self.planner.step(signals, scrape.at)
        self.metrics.record(signals, decisions, self.planner)
        self.last_signals = signals
        for d in decisions.values():
            if d.direction != "hold":
                logger.warning("planner: %s %d -> %d (%s; ttft %s, itl %s, queue %.3fs, kv %s)", d.role, d.current,
                               d.desired, d.reason, _ms(signals.ttft_s), _ms(signals.itl_s), signals.queue_s,
                               signals.kv_usage)
        return decisions


def _ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}ms"

