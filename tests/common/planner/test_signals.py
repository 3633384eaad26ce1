"""What the planner reads from the router's real /metrics text: window quantiles and rates, replicas and decode
KV usage, a prefill worker's queue time; and the watcher deciding only once a window of scrapes is held."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tandem.common.telemetry.metrics import RequestMetrics, RouterMetrics, WorkerSample
from tandem.common.planner import watch
from tandem.common.planner.config import PlannerConfig
from tandem.common.planner.signals import Histogram, parse_router, parse_worker_queue, window

WORKERS = [WorkerSample("127.0.0.1:1", "prefill", True, 0, 0, 0, "closed"),
           WorkerSample("127.0.0.1:2", "decode", True, 0, 0, 0, "closed", kv_total_tokens=1000,
                        kv_free_tokens=250),
           WorkerSample("127.0.0.1:3", "decode", False, 0, 0, 0, "open", kv_total_tokens=1000,
                        kv_free_tokens=750)]


def router_metrics() -> RouterMetrics:
    m = RouterMetrics()
    m.watch(lambda: WORKERS, lambda: 0, lambda: 0)
    return m


def test_histogram_quantile_interpolates_like_prometheus():
    h = Histogram({0.1: 10.0, 0.5: 30.0, 1.0: 40.0, float("inf"): 40.0}, sum=12.0, count=40.0)
    assert h.quantile(0.25) == pytest.approx(0.1)
    assert h.quantile(0.5) == pytest.approx(0.1 + 0.4 * 10 / 20)
    assert h.quantile(0.9) == pytest.approx(0.5 + 0.5 * 6 / 10)
    assert Histogram().quantile(0.9) is None
    assert h.minus(Histogram({0.1: 10.0, 0.5: 10.0, 1.0: 10.0, float("inf"): 10.0}, 1.0, 10.0)).quantile(0.5) == \
        pytest.approx(0.1 + 0.4 * 15 / 20)  # only the 30 observations since


def test_a_window_of_the_routers_metrics():
    m = router_metrics()
    first = parse_router(m.render().decode(), at=100.0)
    for _ in range(9):
        m.request.ttft.observe(0.2)
        m.request.queue_time.observe(0.5)
    m.request.ttft.observe(3.0)
    for _ in range(100):
        m.request.itl.observe(0.02)
    m.observe_usage(prompt_tokens=4000, completion_tokens=600, cached_tokens=0)
    last = parse_router(m.render().decode(), at=110.0)
    assert last.replicas == {"prefill": 1, "decode": 1, "unified": 0}  # the open-breaker decode is not counted
    assert last.kv_usage == pytest.approx(1 - 1000 / 2000)
    s = window(first, last, 0.5, [0.25, 0.75])
    assert s.seconds == 10.0 and s.requests == 10
    assert 0.1 < s.ttft_s <= 0.25 and 0.01 < s.itl_s <= 0.025
    assert s.queue_s == pytest.approx(0.5) and s.prompt_tps == 400.0 and s.generation_tps == 60.0
    assert s.kv_usage == 0.5  # the window's mean, not the last scrape's


def test_a_prefill_workers_queue_time_adds_to_the_window():
    registry = CollectorRegistry()
    prefill = RequestMetrics(registry, "prefill")
    before = parse_worker_queue(generate_latest(registry).decode())
    prefill.queue_time.observe(1.0)
    prefill.queue_time.observe(3.0)
    after = parse_worker_queue(generate_latest(registry).decode())
    m = router_metrics()
    first, last = parse_router(m.render().decode(), 0.0), parse_router(m.render().decode(), 5.0)
    first.prefill_queue["w"], last.prefill_queue["w"] = before, after
    last.prefill_queue["new"] = after  # a worker seen once has no window yet
    assert window(first, last, 0.9, []).queue_s == pytest.approx(2.0)


def test_the_watcher_decides_once_it_holds_a_window(monkeypatch):
    m, clock = router_metrics(), [0.0]
    monkeypatch.setattr(watch, "fetch", lambda url: m.render().decode())
    w = watch.Watcher(PlannerConfig(interval_s=1.0, window_s=3.0), clock=lambda: clock[0])
    ticks = []
    for t in range(6):
        clock[0] = float(t)
        ticks.append(w.tick())
    assert ticks[:3] == [None, None, None]
    assert all(d is not None and d["prefill"].desired == 1 for d in ticks[3:])
    assert w.last_signals.seconds == 3.0  # the oldest scrape kept is a window old, not older
    text = generate_latest(w.metrics.registry).decode()
    assert 'tandem_planner_desired_replicas{role="decode"} 1.0' in text
    assert 'tandem_planner_observed_replicas{role="prefill"} 1.0' in text


def test_an_unreachable_router_is_no_decision(monkeypatch):
    def refuse(url):
        raise OSError("connection refused")
    monkeypatch.setattr(watch, "fetch", refuse)
    w = watch.Watcher(PlannerConfig(), clock=lambda: 0.0)
    assert w.tick() is None and w.metrics.scrape_errors._value.get() == 1
