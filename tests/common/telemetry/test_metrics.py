"""Metrics: histograms count what they observe, scrape-time collectors read stats() and worker samples, several
services' registries live in one process, and /metrics serves text with the exact names the bench reads."""

from __future__ import annotations

import argparse
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.common.bench.metrics import CACHE_HIT_METRIC, CACHE_QUERY_METRIC, cache_counters
from tandem.common.telemetry import metrics as m
from tandem.common.config import ConfigError, WorkerConfig
from tandem.common.flags import add_flags
from tandem.common.telemetry.metrics_server import (maybe_start_metrics_server, metrics_port_from_args,
                                                    start_metrics_server)


def value(registry, name: str, labels: dict | None = None) -> float | None:
    return registry.get_sample_value(name, labels or {})


def test_request_timer_observes_ttft_itl_e2e_and_finish_reason(monkeypatch):
    registry = m.new_registry()
    requests = m.RequestMetrics(registry, "decode")
    clock = iter([10.0, 10.5, 11.0, 11.25, 11.75, 12.0])
    monkeypatch.setattr(m.time, "monotonic", lambda: next(clock))
    timer = requests.start()  # received at 10.0
    timer.admitted()  # 10.5: queued 0.5 s
    timer.admitted()  # observed once only (no clock read)
    timer.tokens(1)  # 11.0: first token, TTFT 1.0
    timer.tokens(1)  # 11.25: gap 0.25
    timer.tokens(2)  # 11.75: two tokens in one chunk, 0.25 each
    timer.finish("stop", prompt_tokens=100, generation_tokens=4)  # 12.0: e2e 2.0
    timer.finish("stop", prompt_tokens=100, generation_tokens=4)  # once only
    role = {"role": "decode"}
    assert value(registry, "tandem_request_queue_time_seconds_count", role) == 1
    assert value(registry, "tandem_request_queue_time_seconds_sum", role) == pytest.approx(0.5)
    assert value(registry, "tandem_time_to_first_token_seconds_count", role) == 1
    assert value(registry, "tandem_time_to_first_token_seconds_sum", role) == pytest.approx(1.0)
    assert value(registry, "tandem_inter_token_latency_seconds_count", role) == 3
    assert value(registry, "tandem_inter_token_latency_seconds_sum", role) == pytest.approx(0.75)
    assert value(registry, "tandem_inter_token_latency_seconds_bucket", {**role, "le": "0.3"}) == 3
    assert value(registry, "tandem_inter_token_latency_seconds_bucket", {**role, "le": "0.2"}) == 0
    assert value(registry, "tandem_e2e_request_latency_seconds_sum", role) == pytest.approx(2.0)
    assert value(registry, "tandem_request_prompt_tokens_sum", role) == 100
    assert value(registry, "tandem_request_generation_tokens_bucket", {**role, "le": "4.0"}) == 1
    assert value(registry, "tandem_requests_finished_total", {**role, "reason": "stop"}) == 1


def test_transfer_and_role_specific_metrics():
    prefill_worker, decode_worker = m.WorkerMetrics("prefill"), m.WorkerMetrics("decode")
    prefill, decode = m.PrefillMetrics(prefill_worker.registry), m.DecodeMetrics(decode_worker.registry)
    prefill.transfer.done(nbytes=8192, pages=4, seconds=0.02)
    prefill.transfer.done(nbytes=4096, pages=2, seconds=0.2)
    prefill.transfer.failed("aborted")
    prefill.bootstrap_wait.observe(0.01)
    prefill.chunks.inc(3)
    decode.prealloc_wait.observe(0.3)
    r, role = prefill_worker.registry, {"role": "prefill"}
    assert value(r, "tandem_kv_transfer_bytes_total", role) == 12288
    assert value(r, "tandem_kv_transfer_pages_total", role) == 6
    assert value(r, "tandem_kv_transfer_duration_seconds_count", role) == 2
    assert value(r, "tandem_kv_transfer_duration_seconds_bucket", {**role, "le": "0.025"}) == 1
    assert value(r, "tandem_kv_transfer_failures_total", {**role, "reason": "aborted"}) == 1
    assert value(r, "tandem_prefill_chunks_total") == 3
    assert value(r, "tandem_prefill_bootstrap_wait_seconds_count") == 1
    assert value(decode_worker.registry, "tandem_decode_prealloc_wait_seconds_sum") == pytest.approx(0.3)
    assert value(decode_worker.registry, "tandem_kv_transfer_bytes_total", role) is None  # separate registries


def test_metrics_off_observe_nothing_and_cost_no_registry():
    off = m.WorkerMetrics.off("prefill")
    assert off.registry is None and off.render() == b""
    prefill = m.PrefillMetrics(off.registry)
    prefill.transfer.done(nbytes=1, pages=1, seconds=0.1)
    prefill.chunks.inc()
    timer = off.requests.start()
    timer.tokens(2)
    timer.finish("stop", 3, 2)
    assert prefill.chunks is m.NOOP_METRIC and off.requests.ttft is m.NOOP_METRIC


def test_expert_imbalance_is_observed_per_moe_layer_labelled_with_the_model_layer():
    worker = m.WorkerMetrics("decode")
    observe = worker.imbalance_observer((1, 3))  # a model whose layers 0 and 2 have a dense MLP
    observe([1.0, 1.5])
    observe([2.0, 1.5])
    r = worker.registry
    assert value(r, "tandem_expert_imbalance_count", {"role": "decode", "layer": "1"}) == 2
    assert value(r, "tandem_expert_imbalance_sum", {"role": "decode", "layer": "1"}) == pytest.approx(3.0)
    assert value(r, "tandem_expert_imbalance_bucket", {"role": "decode", "layer": "3", "le": "1.5"}) == 2
    assert value(r, "tandem_expert_imbalance_bucket", {"role": "decode", "layer": "1", "le": "1.0"}) == 1
    # Nothing to feed: the recorder is given no callback, and skips reading each pass's counts back.
    assert m.WorkerMetrics.off("decode").imbalance_observer((1, 3)) is None
    assert worker.imbalance_observer(()) is None


def test_scheduler_collector_reads_stats_at_scrape_time():
    worker = m.WorkerMetrics("decode")
    current = m.SchedulerStats(queues={"running": 3, "waiting": 1, "prealloc": 2, "transfer": 1},
                               kv_total_tokens=1000, kv_used_tokens=250, kv_cached_tokens=50,
                               prefix_hit_tokens=30, prefix_query_tokens=120, retractions=2, aborts=1)
    calls = []
    worker.watch_scheduler(lambda: calls.append(1) or current)
    assert calls == []  # registering does not call stats()
    r, role = worker.registry, {"role": "decode"}
    assert value(r, "tandem_scheduler_queue_requests", {**role, "queue": "prealloc"}) == 2
    assert value(r, "tandem_scheduler_queue_requests", {**role, "queue": "running"}) == 3
    assert value(r, "tandem_kv_pool_usage_ratio", role) == 0.25
    assert value(r, "tandem_kv_pool_used_tokens", role) == 250
    assert value(r, "tandem_kv_pool_cached_tokens", role) == 50
    assert value(r, "tandem_kv_pool_total_tokens", role) == 1000
    assert value(r, "tandem_radix_cache_hit_rate", role) == 0.25
    assert value(r, "tandem_prefix_cache_hit_tokens_total", role) == 30
    assert value(r, "tandem_prefix_cache_query_tokens_total", role) == 120
    assert value(r, "tandem_retractions_total", role) == 2
    assert value(r, "tandem_aborts_total", role) == 1
    current = m.SchedulerStats(queues={"running": 0, "waiting": 5})
    assert value(r, "tandem_scheduler_queue_requests", {**role, "queue": "waiting"}) == 5
    assert value(r, "tandem_kv_pool_usage_ratio", role) == 0.0  # no division by zero


def test_failing_stats_leave_other_metrics_served():
    worker = m.WorkerMetrics("prefill")

    def broken():
        raise TimeoutError("scheduler did not answer")

    worker.watch_scheduler(broken)
    worker.requests.finished("length")
    text = worker.render().decode()
    assert 'tandem_requests_finished_total{reason="length",role="prefill"} 1.0' in text
    assert "tandem_scheduler_queue_requests" not in text


class _FakeScheduler:
    class outputs:
        class counters:
            num_retractions, num_aborts = 4, 5

    class ops:
        caching = True

        class allocator:
            size = 64

            @staticmethod
            def available_size():
                return 48

        class tree_cache:
            hit_tokens, queried_tokens = 8, 32

            @staticmethod
            def evictable_size():
                return 8

    @staticmethod
    def queue_sizes():
        return {"waiting": 1, "running": 2, "chunked": 0}


def test_read_scheduler_stats_from_a_scheduler():
    s = m.read_scheduler_stats(_FakeScheduler)
    assert s == m.SchedulerStats(queues={"waiting": 1, "running": 2, "chunked": 0}, kv_total_tokens=64,
                                 kv_used_tokens=16, kv_cached_tokens=8, prefix_hit_tokens=8,
                                 prefix_query_tokens=32, retractions=4, aborts=5)
    assert s.kv_usage == 0.25 and s.cache_hit_rate == 0.25


def test_router_metrics_workers_breaker_and_usage():
    router = m.RouterMetrics()
    workers = [m.WorkerSample("10.0.0.1:30000", "prefill", True, 2, 5, 7, "closed"),
               m.WorkerSample("10.0.0.2:30000", "decode", False, 0, 0, 0, "open"),
               m.WorkerSample("10.0.0.3:30000", "decode", True, 1, 1, 0, "half_open")]
    router.watch(lambda: workers, running=lambda: 3, queued=lambda: 1)
    router.sent_to("10.0.0.1:30000", "prefill")
    router.retries.inc()
    router.http_requests.labels("/v1/chat/completions", "200").inc()
    router.observe_usage(prompt_tokens=100, completion_tokens=10, cached_tokens=40)
    r = router.registry
    breaker = "tandem_router_circuit_breaker_state"
    assert value(r, breaker, {"worker": "10.0.0.1:30000", "role": "prefill"}) == 0
    assert value(r, breaker, {"worker": "10.0.0.3:30000", "role": "decode"}) == 1
    assert value(r, breaker, {"worker": "10.0.0.2:30000", "role": "decode"}) == 2
    assert value(r, "tandem_router_worker_healthy", {"worker": "10.0.0.2:30000", "role": "decode"}) == 0
    assert value(r, "tandem_router_worker_in_flight_requests", {"worker": "10.0.0.1:30000", "role": "prefill"}) == 2
    assert value(r, "tandem_router_worker_requests_total", {"worker": "10.0.0.1:30000", "role": "prefill"}) == 1
    assert value(r, "tandem_router_http_requests_total", {"route": "/v1/chat/completions", "status": "200"}) == 1
    assert value(r, "tandem_router_retries_total") == 1
    assert value(r, "tandem_router_running_requests") == 3 and value(r, "tandem_router_queued_requests") == 1
    assert cache_counters(router.render().decode()) == (40.0, 100.0)


def test_every_metric_is_prefixed_and_documented():
    router, worker = m.RouterMetrics(), m.WorkerMetrics("prefill")
    router.watch(lambda: [m.WorkerSample("w", "prefill", True, 0, 0, 0, "closed")], lambda: 0, lambda: 0)
    worker.watch_scheduler(lambda: m.SchedulerStats(queues={"waiting": 0}))
    for registry in (router.registry, worker.registry):
        families = list(text_string_to_metric_families(m.render(registry).decode()))
        assert families
        for family in families:
            assert family.name.startswith("tandem_"), family.name
            assert len(family.documentation) > 10, family.name


def test_role_is_checked():
    with pytest.raises(ValueError, match="role"):
        m.WorkerMetrics("gateway")


def test_metrics_http_server_serves_exact_counter_names():
    worker = m.WorkerMetrics("decode")
    worker.watch_scheduler(lambda: m.SchedulerStats(queues={"running": 1}, prefix_hit_tokens=3,
                                                    prefix_query_tokens=9))
    worker.requests.start().finish("stop", 9, 2)
    server = start_metrics_server(worker.registry, "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain")
            text = resp.read().decode()
    finally:
        server.close()
    assert f'{CACHE_HIT_METRIC}{{role="decode"}} 3.0' in text
    assert f'{CACHE_QUERY_METRIC}{{role="decode"}} 9.0' in text
    assert 'tandem_scheduler_queue_requests{queue="running",role="decode"} 1.0' in text
    assert 'tandem_e2e_request_latency_seconds_count{role="decode"} 1.0' in text
    assert cache_counters(text) == (3.0, 9.0)


def test_metrics_port_flag_env_and_off(monkeypatch):
    def worker_parser() -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser()
        add_flags(parser, WorkerConfig, title="worker", env_prefix="TANDEM_")
        return parser

    monkeypatch.delenv("TANDEM_METRICS_PORT", raising=False)
    assert metrics_port_from_args(worker_parser().parse_args([])) == 0
    assert maybe_start_metrics_server(m.new_registry(), "127.0.0.1", worker_parser().parse_args([])) is None
    monkeypatch.setenv("TANDEM_METRICS_PORT", "9400")
    assert metrics_port_from_args(worker_parser().parse_args([])) == 9400
    assert metrics_port_from_args(worker_parser().parse_args(["--metrics-port", "0"])) == 0  # the flag wins
    monkeypatch.setenv("TANDEM_METRICS_PORT", "nine")
    with pytest.raises(ConfigError, match="TANDEM_METRICS_PORT"):
        worker_parser()
    monkeypatch.delenv("TANDEM_METRICS_PORT")
    with pytest.raises(ValueError, match="--metrics-port"):
        metrics_port_from_args(worker_parser().parse_args(["--metrics-port", "70000"]))


def test_exposed_samples_carry_the_model_name_read_at_scrape_time():
    worker = m.WorkerMetrics("decode")
    worker.requests.start().finish("stop", 3, 2)
    samples = [s for f in text_string_to_metric_families(m.render(worker.exposition("llama-8b")).decode())
               for s in f.samples]
    assert samples and all(s.labels["model_name"] == "llama-8b" and s.labels["role"] == "decode" for s in samples)
    router, name = m.RouterMetrics(), ["unknown"]
    router.watch(lambda: [m.WorkerSample("w", "decode", True, 0, 0, 0, "closed", kv_total_tokens=1000,
                                         kv_free_tokens=400, kv_reserved_tokens=600)],
                 lambda: 0, lambda: 0, model_name=lambda: name[0])
    router.rejected.labels("queue_full").inc()
    name[0] = "tiny"  # the router learns it from its workers after start-up
    text = router.render().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {s.labels["model_name"] for f in families.values() for s in f.samples} == {"tiny"}
    free = families["tandem_router_worker_kv_free_tokens"].samples[0]
    assert free.value == 400 and free.labels == {"worker": "w", "role": "decode", "model_name": "tiny"}
    assert families["tandem_router_worker_kv_reserved_tokens"].samples[0].value == 600
    assert [s.value for s in families["tandem_router_queue_rejections"].samples
            if s.name.endswith("_total") and s.labels["reason"] == "queue_full"] == [1.0]
