"""`tandem bench hicache`: its setup table, sizing checks, the contract metrics it reads, and one real run of the
L1 setup on the tiny model."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from tandem.common.bench import hicache
from tandem.common.bench.hicache import (SETUPS, HiCacheBenchConfig, WorkerCounters, check_sizes, render_markdown,
                                         tier_figures, working_set_tokens)
from tandem.common.bench.workloads import multi_turn_requests
from tests.common.rpc.helpers import cli_in_process


def test_setups_are_the_contracts_worker_flags():
    assert SETUPS["l1"].flags(2.0, "file", "/l3") == ()
    assert SETUPS["l1+l2"].flags(3.0, "file", "/l3") == ("--enable-hierarchical-cache", "--hicache-ratio", "3.0")
    l3 = ("--enable-hierarchical-cache", "--hicache-ratio", "2.0", "--hicache-storage-backend", "nixl",
          "--hicache-storage-dir", "/l3", "--hicache-storage-prefetch-policy", "wait_complete")
    assert SETUPS["l1+l2+l3"].flags(2.0, "nixl", "/l3") == l3 and SETUPS["l1+l2+l3"].empty_storage
    # The second worker starts on the directory the first one filled.
    assert SETUPS["l3-second-worker"].flags(2.0, "nixl", "/l3") == l3 and not SETUPS["l3-second-worker"].empty_storage
    assert SETUPS["l1+l2+l3"].flags(2.0, "file", "/l3", "timeout")[-1] == "timeout"


def test_config_refuses_setups_it_cannot_run():
    with pytest.raises(ValueError, match="unknown"):
        HiCacheBenchConfig(setups=("l1", "l4")).validate()
    with pytest.raises(ValueError, match="l1\\+l2\\+l3 before it"):
        HiCacheBenchConfig(setups=("l3-second-worker", "l1+l2+l3")).validate()
    with pytest.raises(ValueError, match="--concurrency"):
        HiCacheBenchConfig(conversations=2, concurrency=3).validate()
    HiCacheBenchConfig().validate()


def test_working_set_counts_each_conversations_longest_prompt_and_must_exceed_the_l1():
    requests = multi_turn_requests(4, num_turns=3, turn_len=20, reply_len=10, output_len=8, seed=0)
    working_set, largest = working_set_tokens(requests, lambda text: len(text.split()))
    last_turn_words = 3 * (20 + 4) + 2 * 10
    assert working_set == 4 * last_turn_words and largest == last_turn_words + 8
    check_sizes(HiCacheBenchConfig(l1_tokens=100, min_working_set_ratio=3.5), working_set, largest)
    with pytest.raises(ValueError, match="working set"):
        check_sizes(HiCacheBenchConfig(l1_tokens=200), working_set, largest)
    with pytest.raises(ValueError, match="longest request"):
        check_sizes(HiCacheBenchConfig(l1_tokens=80, min_working_set_ratio=1), working_set, largest)


def _worker_metrics(host_hits: float, disk_hits: float, host_bytes: float, disk_bytes: float,
                    load_back: list[float]) -> str:
    """The contract's worker metrics as prometheus_client exports them."""
    registry = CollectorRegistry()
    hits = Counter("tandem_hicache_hit_tokens", "", ["tier"], registry=registry)
    moved = Counter("tandem_hicache_bytes", "", ["tier", "direction"], registry=registry)
    seconds = Histogram("tandem_hicache_load_back_seconds", "", registry=registry)
    hits.labels("device").inc(100)
    hits.labels("host").inc(host_hits)
    hits.labels("disk").inc(disk_hits)
    moved.labels("host", "read").inc(host_bytes)
    moved.labels("disk", "read").inc(disk_bytes)
    moved.labels("disk", "write").inc(10**9)  # writes are no load-back
    for s in load_back:
        seconds.observe(s)
    return generate_latest(registry).decode()


def test_tier_hit_rates_and_load_back_bandwidth_come_from_the_contract_metrics():
    before = WorkerCounters.parse(_worker_metrics(0, 0, 0, 0, []))
    after = WorkerCounters.parse(_worker_metrics(300, 100, 2e9, 1e9, [0.5, 1.0]))
    figures = tier_figures(after.since(before), queried_tokens=1000)
    assert figures["hit_rate_by_tier"] == {"device": 0.0, "host": 0.3, "disk": 0.1}  # device: 100 before and after
    assert figures["read_bytes_by_tier"] == {"host": 2e9, "disk": 1e9}
    assert figures["load_back_seconds"] == 1.5 and figures["load_back_gbps"] == pytest.approx(2.0)


def test_a_worker_without_hicache_metrics_reports_no_tier_figures():
    empty = WorkerCounters.parse("# nothing here\n")
    assert tier_figures(empty.since(empty), 1000) == {"hit_rate_by_tier": None, "read_bytes_by_tier": None,
                                                      "load_back_seconds": None, "load_back_gbps": None}


def test_memcpy_reference_is_measured():
    assert hicache.memcpy_bandwidth(1, repeats=2)["host_to_host_gbps"] > 0


def test_markdown_shows_each_setup_and_a_setup_that_did_not_start():
    ok = {"setup": "l1", "completed": 3, "failed": 0, "cache_hit_rate": 0.25,
          "hit_rate_by_tier": {"device": 0.1, "host": 0.1, "disk": 0.05}, "ttft_ms": {"p50": 10.0, "p99": 20.0},
          "output_throughput": 5.0, "load_back_gbps": 1.5}
    result = {"working_set_tokens": 4000, "l1_tokens": 1000, "memcpy": {"host_to_host_gbps": 8.0},
              "setups": {"l1": ok, "l1+l2": {"setup": "l1+l2", "error": "worker exited with code 2; last lines:\n"
                                                                "tandem: error: unrecognized arguments: --x"}}}
    text = render_markdown(result)
    assert "(4.0x)" in text and "| l1 | 3 / 0 | 25% | 10% / 10% / 5% | 10 / 20 | 5.0 | 1.50 |" in text
    assert "| l1+l2 | failed to run: tandem: error: unrecognized arguments: --x |" in text


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hicache_bench_runs_the_l1_setup_on_the_tiny_model(tiny_llama, tmp_path, capsys):
    out = tmp_path / "hicache.json"
    code = cli_in_process(["bench", "hicache", "--model", tiny_llama, "--setups", "l1", "--conversations", "6",
                           "--turns", "2", "--turn-words", "24", "--reply-words", "8", "--output-len", "4",
                           "--concurrency", "3", "--l1-tokens", "256", "--threads", "1", "--memcpy-mib", "8",
                           "--output-json", str(out)])
    assert code == 0, capsys.readouterr().err[-3000:]
    result = json.loads(out.read_text())
    assert result["working_set_tokens"] >= 4 * 256 and result["memcpy"]["host_to_host_gbps"] > 0
    l1 = result["setups"]["l1"]
    assert l1["completed"] == 12 and l1["failed"] == 0
    assert "--max-total-tokens" in l1["worker_flags"] and "256" in l1["worker_flags"]
    assert l1["cache_hit_rate"] is not None and 0.0 <= l1["cache_hit_rate"] < 1.0
    assert l1["ttft_ms"]["p50"] > 0 and l1["output_throughput"] > 0
    assert l1["hit_rate_by_tier"] is None  # no HiCache in L1 only
    assert l1["leaks"] == {"requests": 0, "kv_tokens": 0}
