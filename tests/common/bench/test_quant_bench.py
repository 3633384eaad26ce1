"""`tandem bench quant` on the tiny model: every format's row has its weight bytes under the unquantized model's,
a speed, and accuracy against the unquantized run; an already quantized --model and unknown formats are refused."""

from __future__ import annotations

import json

from tandem.common import cli
from tandem.common.model.create import create_model

SHORT = ["--num-prompts", "2", "--input-len", "8", "--output-len", "6", "--num-threads", "1", "--dtype", "float32"]


def test_each_format_is_measured_against_the_unquantized_run(tiny_llama, tmp_path):
    out = tmp_path / "quant.json"
    assert cli.main(["bench", "quant", "--model", tiny_llama, *SHORT, "--output-json", str(out)]) == 0
    rows = {r["format"]: r for r in json.loads(out.read_text())["results"]}
    assert list(rows) == ["unquantized", "fp8", "fp8-channel", "online-fp8", "online-int8", "awq", "gptq",
                          "gptq-actorder"]
    base = rows.pop("unquantized")
    assert base["weight_bytes"] == 2 * base["bf16_weight_bytes"]  # float32
    for fmt, row in rows.items():
        assert row["weight_bytes"] < 0.7 * base["weight_bytes"], fmt  # tiny: the float32 embeddings dominate
        assert row["output_tokens_per_s"] > 0
        if fmt in ("awq", "gptq", "gptq-actorder"):  # 4 bits on random weights: near-tied logits flip often
            assert 0 < row["greedy_equal_share"] <= 1.0 and 0 < row["mean_abs_delta_logprob"] < 1.5, fmt
        else:
            assert 0.5 <= row["greedy_equal_share"] <= 1.0 and 0 < row["mean_abs_delta_logprob"] < 1.0, fmt


def test_a_quantized_model_and_unknown_formats_are_refused(tiny_llama, tmp_path, capsys):
    path = str(tmp_path / "fp8")
    create_model(path, preset="tiny", quantize="fp8")
    assert cli.main(["bench", "quant", "--model", path, *SHORT]) == 2
    assert "is already quantized" in capsys.readouterr().err
    assert cli.main(["bench", "quant", "--model", tiny_llama, "--formats", "nf4"]) == 2
    assert "--formats nf4: unknown" in capsys.readouterr().err
