"""`tandem bench report`: each section runs end to end on the tiny model (real processes on 127.0.0.1, small
workloads, one round) and reports that section's figures in its printed JSON and in the files it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.common import cli

REPO = Path(__file__).resolve().parents[3]

# One round of each comparison, sized to take seconds on 2 CPU cores; the worker start-ups dominate.
SMALL = {
    "offline": ["--offline-prompts", "4", "--offline-input-len", "16", "--offline-output-len", "8"],
    "pd": ["--pd-duration", "2", "--pd-short-rate", "2", "--pd-long-every", "1", "--pd-long-len", "60"],
    # 10 req/s: a group's second request comes ~0.4 s after its first, long after the tiny model's prefill
    "prefix": ["--prefix-requests", "8", "--prefix-rate", "10", "--prefix-words", "32",
               "--policy-requests", "10", "--policy-rate", "20", "--policy-prefix-words", "24"],
    "overhead": ["--overhead-requests", "3", "--overhead-input-len", "12", "--overhead-output-len", "6"],
    "kv": ["--kv-tokens", "64,128", "--kv-repeats", "2"],
    "serving": ["--serving-prompts", "6", "--serving-input-len", "12", "--serving-output-len", "8",
                "--serving-concurrency", "3", "--serving-latency-requests", "2", "--serving-latency-output-len", "4"],
}


def run_section(section: str, model: str, out_dir, capsys, *extra: str) -> dict:
    argv = ["bench", "report", "--model", model, "--out-dir", str(out_dir), "--sections", section, "--rounds", "1",
            *SMALL[section], *extra]
    assert cli.main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((out_dir / "report.json").read_text())
    assert printed == {section: written[section]}
    assert json.loads((out_dir / f"{section}.result.json").read_text()) == written[section]
    assert written["machine"]["cpus"] >= 1 and written[f"{section}_seconds"] > 0
    return written[section]


def assert_served(summary: dict, requests: int) -> None:
    assert summary["completed"] == requests and summary["failed"] == 0, summary.get("errors")
    assert summary["output_throughput"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert summary[key]["p50"] is not None and summary[key]["p50"] <= summary[key]["max"]


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_offline_section_creates_the_model_and_compares_stack_with_engine(tmp_path, capsys):
    model = tmp_path / "model"  # absent: the report creates the built-in model of --preset
    result = run_section("offline", str(model), tmp_path / "out", capsys, "--preset", "tiny")
    assert json.loads((model / "config.json").read_text())["num_hidden_layers"] == 2  # the tiny preset
    (stack,), (engine,) = result["stack"], result["offline_engine"]
    assert_served(stack, 4)
    assert engine["output_tokens"] == 4 * 8 and engine["output_throughput"] > 0


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_pd_section_reports_short_and_long_streams_for_both_setups(tiny_llama, tmp_path, capsys):
    result = run_section("pd", tiny_llama, tmp_path, capsys)
    for setup in ("pd", "unified"):
        (run,) = result[setup]
        assert run["short"]["completed"] >= 1 and run["short"]["failed"] == 0
        assert run["short"]["itl_ms"]["max"] is not None
        assert_served(run["long"], 2)  # one every second over 2 seconds


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_prefix_section_reports_hits_with_the_radix_cache_and_none_without(tiny_llama, tmp_path, capsys):
    result = run_section("prefix", tiny_llama, tmp_path, capsys)
    (on,), (off,) = result["radix_on"], result["radix_off"]
    assert_served(on, 8)
    assert_served(off, 8)
    assert on["cache_hit_rate"] > 0 and off["cache_hit_rate"] == 0
    for policy in ("cache_aware", "round_robin"):
        (run,) = result[policy]
        assert_served(run, 10)
        assert run["cache_hit_rate"] is not None
    pool = result["policy_prefill_pool_tokens"]
    assert pool > 0 and pool % 16 == 0


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_overhead_section_times_router_and_direct_paths(tiny_llama, tmp_path, capsys):
    result = run_section("overhead", tiny_llama, tmp_path, capsys)
    for path in ("router", "direct"):
        stats = result[path]
        assert stats["n"] == 3 and stats["tokens"] == [6]
        assert 0 < stats["ttft_ms"]["p50"] <= stats["e2e_ms"]["p50"]
    assert result["router"]["prompt_tokens"] == result["direct"]["prompt_tokens"]  # the same prompts


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_kv_section_reports_nixl_and_copy_throughput(tmp_path, capsys):
    result = run_section("kv", str(tmp_path / "unused-model"), tmp_path / "out", capsys)
    assert result["repeats"] == 2
    assert [r["tokens"] for r in result["results"]] == [64, 128]
    assert all(r["nixl_gbps_median"] > 0 and r["copy_gbps_median"] > 0 for r in result["results"])
    assert not (tmp_path / "unused-model").exists()  # the kv section needs no model


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_serving_section_reports_router_cpu_per_token_and_added_latency_for_both_trees(tiny_llama, tmp_path,
                                                                                       capsys):
    baseline = tmp_path / "baseline-checkout"
    baseline.symlink_to(REPO)  # another path to a checkout: its processes run with cwd and PYTHONPATH there
    result = run_section("serving", tiny_llama, tmp_path / "out", capsys, "--serving-baseline-tree", str(baseline))
    assert result["trees"] == {"this": str(REPO), "baseline": str(baseline)}
    for tree in ("this", "baseline"):
        (run,) = result["loaded"][tree]
        assert_served(run, 6)
        assert run["output_tokens"] == 6 * 8
        assert 0 < run["sse_chunks_per_token"] <= 1  # never more SSE chunks than tokens; fewer when coalesced
        assert run["router_cpu_s"] > 0 and run["router_cpu_us_per_token"] > 0 and run["worker_cpu_s"] > 0
        latency = result["added_latency"][tree]
        for path in ("router", "direct"):
            stats = latency[path]
            assert stats["n"] == 2 and 0 < stats["ttft_ms"]["p50"] <= stats["e2e_ms"]["p50"]
        assert set(latency["added_ms"]) == {"ttft_ms", "e2e_ms"}


def test_a_baseline_tree_that_is_not_a_checkout_is_rejected(tmp_path):
    argv = ["bench", "report", "--out-dir", str(tmp_path / "out"), "--sections", "serving",
            "--serving-baseline-tree", str(tmp_path)]
    assert cli.main(argv) == 2
    assert not (tmp_path / "out").exists()


def test_unknown_section_is_rejected_before_anything_starts(tmp_path):
    argv = ["bench", "report", "--out-dir", str(tmp_path), "--sections", "offline,bogus"]
    assert cli.main(argv) == 2  # a ValueError: tandem prints it as a usage error
    assert not any(tmp_path.iterdir())
