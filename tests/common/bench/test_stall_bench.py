"""`tandem bench stall` on the tiny model: streams decode while long prompts are prefilled in small chunks; both
configurations run in each round, and with mixed chunks the streams keep decoding through the chunks."""

from __future__ import annotations

import json

import pytest

from tandem.common import cli
from tandem.common.bench.stall import gap_stats


def test_gap_stats_reads_max_p99_and_p50_in_ms():
    stats = gap_stats([0.001 * i for i in range(1, 101)])
    assert stats == pytest.approx({"itl_max_ms": 100.0, "itl_p99_ms": 100.0, "itl_p50_ms": 51.0})


def test_reports_both_configurations_each_round(tiny_llama, tmp_path, capsys):
    out = tmp_path / "stall.json"
    argv = ["bench", "stall", "--model", tiny_llama, "--dtype", "float32", "--chunked-prefill-size", "32",
            "--streams", "3", "--stream-prompt-len", "8", "--stream-tokens", "40", "--long-prompts", "2",
            "--long-len", "400", "--long-after-s", "0.05", "--rounds", "2", "--output-json", str(out)]
    assert cli.main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["round"], r["enable_mixed_chunk"]) for r in rows] == [(0, False), (0, True), (1, True), (1, False)]
    for row in rows:
        assert row["stream_tokens"] == 3 * 40  # every stream ran to the end
        assert 0 < row["itl_p50_ms"] <= row["itl_p99_ms"] <= row["itl_max_ms"]
        assert row["long_ttft_max_s"] > 0 and row["wall_s"] > 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 4


@pytest.mark.e2e
def test_runs_a_pipeline_too(tiny_llama, tmp_path):
    """--pp-size 2: both configurations through a two-stage pipeline (the normal loop, where mixed chunks run)."""
    out = tmp_path / "stall.json"
    argv = ["bench", "stall", "--model", tiny_llama, "--dtype", "float32", "--chunked-prefill-size", "32",
            "--streams", "2", "--stream-prompt-len", "8", "--stream-tokens", "24", "--long-prompts", "1",
            "--long-len", "200", "--long-after-s", "0.05", "--rounds", "1", "--pp-size", "2", "--event-loop", "normal",
            "--output-json", str(out)]
    assert cli.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["pp_size"] == 2
    assert [r["stream_tokens"] for r in doc["results"]] == [2 * 24, 2 * 24]


def test_a_refused_combination_stops_before_any_round(tiny_llama, capsys):
    """--pp-size 2 in the pipelined loop refuses mixed chunks: said at once, not after the first configuration ran."""
    argv = ["bench", "stall", "--model", tiny_llama, "--pp-size", "2", "--rounds", "1"]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert "--enable-mixed-chunk with --pp-size > 1 needs --event-loop normal" in captured.err
    assert captured.out == ""
