"""What the planner reads: one scrape of the router's and the workers' Prometheus metrics reduced to a
`Scrape`, and two scrapes a window apart reduced to `Signals` (quantiles and rates over the window, so one
scrape's noise or one burst does not read as the load)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from prometheus_client.parser import text_string_to_metric_families

from tandem.common.roles import Role

TTFT = "tandem_time_to_first_token_seconds"
ITL = "tandem_inter_token_latency_seconds"
QUEUE = "tandem_request_queue_time_seconds"
PROMPT_TOKENS = "tandem_router_prompt_tokens"
GENERATION_TOKENS = "tandem_router_generation_tokens"
HEALTHY = "tandem_router_worker_healthy"
KV_TOTAL = "tandem_router_worker_kv_total_tokens"
KV_FREE = "tandem_router_worker_kv_free_tokens"


@dataclass
class Histogram:
    """Cumulative bucket counts by upper bound, plus sum and count (one role's series)."""

    buckets: dict[float, float] = field(default_factory=dict)
    sum: float = 0.0
    count: float = 0.0

    def minus(self, earlier: "Histogram") -> "Histogram":
        """The observations since `earlier`; a reset (a restarted process) counts from zero."""
        if self.count < earlier.count:
            return self
        return Histogram({le: n - earlier.buckets.get(le, 0.0) for le, n in self.buckets.items()},
                         self.sum - earlier.sum, self.count - earlier.count)

    def quantile(self, q: float) -> Optional[float]:
        """Prometheus' histogram_quantile: linear within the bucket; None without observations."""
        if self.count <= 0:
            return None
        rank, lower, below = q * self.count, 0.0, 0.0
        for le in sorted(self.buckets):
            n = self.buckets[le]
            if n >= rank:
                if math.isinf(le):
                    return lower  # beyond the last finite bucket: its bound is the best known
                return lower + (le - lower) * ((rank - below) / (n - below) if n > below else 1.0)
            lower, below = le, n
        return lower

    def mean(self) -> Optional[float]:
        return self.sum / self.count if self.count > 0 else None


@dataclass
class Scrape:
    """One moment of the deployment: the router's figures and each worker's prefill queue time."""

    at: float
    ttft: Histogram
    itl: Histogram
    router_queue: Histogram
    prompt_tokens: float
    generation_tokens: float
    replicas: dict[str, int]  # healthy workers per role, as the router sees them
    kv_usage: Optional[float]  # decode KV committed / total, over the decode workers (router's view)
    prefill_queue: dict[str, Histogram] = field(default_factory=dict)  # worker metrics URL -> its queue time


def _histogram(samples: list, name: str, role: str) -> Histogram:
    h = Histogram()
    for s in samples:
        if s.labels.get("role") != role:
            continue
        if s.name == name + "_bucket":
            le = float(s.labels["le"])
            h.buckets[le] = h.buckets.get(le, 0.0) + s.value
        elif s.name == name + "_sum":
            h.sum += s.value
        elif s.name == name + "_count":
            h.count += s.value
    return h


def _samples(text: str) -> dict[str, list]:
    """Samples by family name (counters' `_total` suffix dropped, as the parser names families)."""
    return {f.name: list(f.samples) for f in text_string_to_metric_families(text)}


def parse_router(text: str, at: float) -> Scrape:
    families = _samples(text)

    def total(name: str) -> float:
        return sum(s.value for s in families.get(name, []) if s.name == name + "_total")

    replicas = {str(r): 0 for r in (Role.PREFILL, Role.DECODE, Role.UNIFIED)}
    for s in families.get(HEALTHY, []):
        if s.value >= 1 and s.labels.get("role") in replicas:
            replicas[s.labels["role"]] += 1
    decode_total = {s.labels["worker"]: s.value for s in families.get(KV_TOTAL, [])
                    if s.labels.get("role") == Role.DECODE}
    decode_free = {s.labels["worker"]: s.value for s in families.get(KV_FREE, [])
                   if s.labels.get("worker") in decode_total}
    capacity = sum(decode_total.values())
    kv_usage = (1.0 - sum(decode_free.values()) / capacity) if capacity > 0 else None
    router_samples = families.get(TTFT, []) + families.get(ITL, []) + families.get(QUEUE, [])
    return Scrape(at, _histogram(router_samples, TTFT, Role.ROUTER), _histogram(router_samples, ITL, Role.ROUTER),
                  _histogram(router_samples, QUEUE, Role.ROUTER), total(PROMPT_TOKENS), total(GENERATION_TOKENS),
                  replicas, kv_usage)


def parse_worker_queue(text: str) -> Histogram:
    """A prefill worker's scheduler queue time (the wait before its prefill started)."""
    return _histogram(_samples(text).get(QUEUE, []), QUEUE, Role.PREFILL)


@dataclass
class Signals:
    """The load over one window, as the decision reads it."""

    seconds: float
    ttft_s: Optional[float]  # the window's TTFT quantile (None: no first token in the window)
    itl_s: Optional[float]
    queue_s: float  # mean wait before a prefill started: router admission + prefill workers' queues
    prompt_tps: float  # prompt tokens served per second
    generation_tps: float
    requests: float  # first tokens sent in the window
    replicas: dict[str, int]
    kv_usage: Optional[float]


def window(first: Scrape, last: Scrape, quantile: float, kv_usages: list[float]) -> Signals:
    """The signals between two scrapes; `kv_usages`: the decode KV usage of every scrape in between (its mean
    is the window's, so one scrape at a peak does not decide)."""
    seconds = max(last.at - first.at, 1e-9)
    ttft, itl = last.ttft.minus(first.ttft), last.itl.minus(first.itl)
    queue = last.router_queue.minus(first.router_queue).mean() or 0.0
    waits = [h.minus(first.prefill_queue[url]) for url, h in last.prefill_queue.items() if url in first.prefill_queue]
    count = sum(h.count for h in waits)
    if count > 0:
        queue += sum(h.sum for h in waits) / count
    return Signals(seconds, ttft.quantile(quantile), itl.quantile(quantile), queue,
                   max(0.0, last.prompt_tokens - first.prompt_tokens) / seconds,
                   max(0.0, last.generation_tokens - first.generation_tokens) / seconds, ttft.count,
                   dict(last.replicas), sum(kv_usages) / len(kv_usages) if kv_usages else None)
