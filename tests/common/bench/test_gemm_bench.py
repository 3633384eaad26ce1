"""`tandem bench gemm` on the tiny preset's shapes: every path's rate and error per shape and row count, in the
table and the JSON, against the probe's peak (shrunk here to stay fast)."""

from __future__ import annotations

import json

import pytest

from tandem.common import cli
from tandem.common.bench import machine_probe
from tandem.common.bench.gemm import model_shapes
from tandem.common.model.config import ModelConfig
from tandem.common.model.cpu_linear import onednn_packs_bf16
from tandem.common.model.create import model_config_dict


def test_shapes_are_the_layers_linears():
    shapes = model_shapes(ModelConfig.from_hf_dict(model_config_dict("llama", "small")))
    assert shapes == {"qkv": (1024, 512), "o": (512, 512), "gate_up": (3072, 512), "down": (512, 1536),
                      "lm_head": (8192, 512)}


def test_survey_reports_every_path_against_the_peak(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(machine_probe, "FMA_REP_S", 0.005)
    monkeypatch.setattr(machine_probe, "MIN_COPY_BYTES", 8 << 20)
    monkeypatch.setattr(machine_probe, "MAX_COPY_BYTES", 8 << 20)
    machine_probe.measure_machine.cache_clear()
    out = tmp_path / "gemm.json"
    argv = ["bench", "gemm", "--presets", "tiny", "--rows", "1,9", "--dtypes", "float32,bfloat16",
            "--output-json", str(out)]
    assert cli.main(argv) == 0
    machine_probe.measure_machine.cache_clear()
    doc = json.loads(out.read_text())
    peak = doc["machine"]["peak_gflops"]
    results = doc["results"]
    assert len(results) == 2 * 5 * 2  # dtypes x shapes x row counts
    for r in results:
        paths = r["paths"]
        assert "mkl" in paths and r["best"] in paths
        # oneDNN packs a bf16 weight only with avx512bw/vl/dq or avx_ne_convert (not on an AVX2-only CPU)
        onednn = r["dtype"] == "float32" or onednn_packs_bf16()
        assert {"onednn", "onednn-m"} & set(paths) == ({"onednn", "onednn-m"} if onednn else set())
        assert ("onednn-fp32" in paths) == (r["dtype"] == "bfloat16")
        assert ("mkl-packed" in paths) == (r["dtype"] == "float32")
        assert "tandem" in paths  # a bf16 weight: its bf16 panels widened in registers (--cpu-bf16-matmul widen)
        for p in paths.values():
            assert p["pct_of_peak"] == pytest.approx(100 * p["gflops_per_s"] / peak)
            assert p["max_rel_err"] < (1e-4 if r["dtype"] == "float32" else 2e-2)
    table = capsys.readouterr().out
    assert "gate_up" in table and "% of FMA peak" in table


def test_int4_survey_times_each_4_bit_path(tmp_path, monkeypatch):
    """--dtypes int4: our 4-bit kernel and torch's int4 kernel (float32 rows only at few rows, bf16 rows at all)
    against x @ W.T of the same 4-bit weight in float64."""
    from tandem.common.model import cpu_gemm

    monkeypatch.setattr(machine_probe, "FMA_REP_S", 0.005)
    monkeypatch.setattr(machine_probe, "MIN_COPY_BYTES", 8 << 20)
    monkeypatch.setattr(machine_probe, "MAX_COPY_BYTES", 8 << 20)
    machine_probe.measure_machine.cache_clear()
    out = tmp_path / "gemm.json"
    assert cli.main(["bench", "gemm", "--presets", "tiny", "--rows", "3,12", "--dtypes", "int4",
                     "--output-json", str(out)]) == 0
    machine_probe.measure_machine.cache_clear()
    results = json.loads(out.read_text())["results"]
    assert len(results) == 5 * 2 and {r["dtype"] for r in results} == {"int4"}
    for r in results:
        paths = r["paths"]
        assert ("tandem-int4" in paths) == bool(cpu_gemm.panel_widths())
        if r["n"] % 16 == 0:
            assert "torch-int4-bf16" in paths and ("torch-int4" in paths) == (r["m"] <= 8)
        for name, p in paths.items():
            assert p["max_rel_err"] < (2e-2 if name.endswith("bf16") else 1e-4), name
    with pytest.raises(SystemExit, match="--dtypes takes"):
        cli.main(["bench", "gemm", "--presets", "tiny", "--rows", "1", "--dtypes", "int8"])
