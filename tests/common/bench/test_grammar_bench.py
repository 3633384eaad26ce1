"""`tandem bench grammar` on the tiny model: the mask's per-step parts and the engine's step time with and without
a constraint, at two batch sizes."""

from __future__ import annotations

import json

import pytest

from tandem.common import cli

pytestmark = pytest.mark.e2e


def test_reports_mask_and_engine_step_costs(tiny_llama, tmp_path, capsys):
    out = tmp_path / "grammar.json"
    argv = ["bench", "grammar", "--model", tiny_llama, "--batch-sizes", "1,3", "--steps", "20", "--output-len", "8",
            "--event-loop", "normal", "--output-json", str(out)]
    assert cli.main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    masks = [r for r in rows if r["part"] == "mask"]
    engines = [r for r in rows if r["part"] == "engine"]
    assert [r["batch"] for r in masks] == [r["batch"] for r in engines] == [1, 3]
    for row in masks:
        assert row["step_ms"] > 0 and row["fill_ms"] > 0 and row["apply_ms"] > 0 and row["accept_ms"] > 0
    for row in engines:
        assert row["plain_tokens"] == 8 * row["batch"]  # ignore_eos: every unconstrained row runs to the end
        assert 0 < row["regex_tokens"] <= 8 * row["batch"] and row["regex_step_ms"] > 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 4
