"""Metric math of `tandem bench serve`, checked against hand-computed values."""

from __future__ import annotations

import pytest

from tandem.common.bench.metrics import (SLO, RequestRecord, cache_counters, cache_hit_rate, latency_stats_ms,
                                         prometheus_total, summarize)


def record(ttft: float, e2e: float, tokens: int, itl=(), prompt_len: int = 10, success: bool = True) -> RequestRecord:
    return RequestRecord(prompt_len=prompt_len, output_len=tokens, success=success, ttft=ttft, e2e=e2e,
                         itl=list(itl), output_tokens=tokens, error="" if success else "boom")


def test_percentiles_interpolate_linearly():
    # 1..10 ms: rank (n-1)*q -> p50 at 4.5 -> 5.5 ms, p90 at 8.1 -> 9.1 ms, p99 at 8.91 -> 9.91 ms.
    stats = latency_stats_ms([i / 1000 for i in range(1, 11)])
    assert stats == pytest.approx({"mean": 5.5, "p50": 5.5, "p90": 9.1, "p99": 9.91, "max": 10.0})


def test_empty_latencies_are_none():
    assert latency_stats_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}


def test_tpot_excludes_the_first_token():
    # 0.1 s to the first token, then 4 more tokens over 0.4 s: 100 ms per output token.
    assert record(ttft=0.1, e2e=0.5, tokens=5).tpot == pytest.approx(0.1)
    assert record(ttft=0.1, e2e=0.5, tokens=1).tpot is None
    assert record(ttft=0.1, e2e=0.5, tokens=5, success=False).tpot is None


def test_goodput_counts_requests_meeting_every_target():
    records = [
        record(ttft=0.05, e2e=0.15, tokens=11),  # ttft 50 ms, tpot 10 ms: good
        record(ttft=0.30, e2e=0.40, tokens=11),  # ttft 300 ms: misses the TTFT target
        record(ttft=0.05, e2e=1.05, tokens=11),  # tpot 100 ms: misses the TPOT target
        record(ttft=0.05, e2e=0.05, tokens=1),   # one token: no TPOT, meets TTFT: good
        record(ttft=0.0, e2e=0.0, tokens=0, success=False),
    ]
    s = summarize(records, duration_s=2.0, slo=SLO(ttft_ms=100, tpot_ms=20))
    assert s["good_requests"] == 2
    assert s["goodput"] == pytest.approx(1.0)
    assert s["completed"] == 4 and s["failed"] == 1 and s["errors"] == {"boom": 1}


def test_goodput_is_none_without_targets():
    s = summarize([record(ttft=0.1, e2e=0.2, tokens=3)], duration_s=1.0, slo=SLO())
    assert s["goodput"] is None and s["good_requests"] is None


def test_throughputs_count_only_successful_requests():
    records = [record(0.1, 1.0, tokens=10, prompt_len=100), record(0.1, 1.0, tokens=30, prompt_len=50),
               record(0, 0, tokens=99, prompt_len=1000, success=False)]
    s = summarize(records, duration_s=4.0, slo=SLO())
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["input_throughput"] == pytest.approx(150 / 4)
    assert s["output_throughput"] == pytest.approx(40 / 4)
    assert s["total_output_tokens"] == 40


def test_itl_stats_pool_gaps_of_all_requests():
    records = [record(0.1, 0.4, tokens=3, itl=[0.1, 0.2]), record(0.1, 0.4, tokens=2, itl=[0.3])]
    s = summarize(records, duration_s=1.0, slo=SLO())
    assert s["itl_ms"]["mean"] == pytest.approx(200.0)
    assert s["itl_ms"]["p50"] == pytest.approx(200.0)
    # tpot: (0.4-0.1)/2 = 150 ms and (0.4-0.1)/1 = 300 ms
    assert s["tpot_ms"]["mean"] == pytest.approx(225.0)


METRICS_TEXT = """\
# HELP tandem_prefix_cache_hit_tokens_total Prompt tokens served from the prefix cache
# TYPE tandem_prefix_cache_hit_tokens_total counter
tandem_prefix_cache_hit_tokens_total{worker="p0"} 30.0
tandem_prefix_cache_hit_tokens_total{worker="p1"} 10.0
tandem_prefix_cache_hit_tokens_created{worker="p0"} 1.7e9
tandem_prefix_cache_query_tokens_total 200
"""


def test_prometheus_totals_sum_label_sets_and_skip_lookalikes():
    assert prometheus_total(METRICS_TEXT, "tandem_prefix_cache_hit_tokens_total") == 40.0
    assert prometheus_total(METRICS_TEXT, "tandem_prefix_cache_query_tokens_total") == 200.0
    assert prometheus_total(METRICS_TEXT, "missing_total") is None


def test_cache_hit_rate_uses_deltas():
    before = cache_counters(METRICS_TEXT)
    assert before == (40.0, 200.0)
    assert cache_hit_rate(before, (100.0, 300.0)) == pytest.approx(0.6)
    assert cache_hit_rate(None, (100.0, 300.0)) is None
    assert cache_hit_rate(before, before) is None  # nothing queried
    assert cache_counters("vllm_other_metric 1\n") is None
