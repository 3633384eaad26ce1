"""`tandem generate`: JSONL in, JSONL out, through the console entry point (in this process and as a process)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tests.common.rpc.helpers import cli_in_process


def test_generate_jsonl_matches_engine(tiny_llama, tmp_path, capsys):
    lines = [
        {"id": "a", "input_ids": [5, 9, 33, 70], "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
        {"id": "b", "text": "héllo wörld 中文", "sampling_params": {"max_new_tokens": 5, "temperature": 0},
         "return_logprob": True, "top_logprobs_num": 2},
        {"id": "c", "input_ids": [7, 8], "sampling_params": {"max_new_tokens": 4, "temperature": 0.9,
                                                            "seed": 3, "n": 2}},
        {"id": "bad", "input_ids": [7], "sampling_params": {"temperature": -1}},
        {"id": "unknown", "input_ids": [7], "sampling_params": {"temprature": 1}},
        {"id": "json", "input_ids": [7, 9], "sampling_params": {
            "max_new_tokens": 300, "temperature": 0, "json_schema": {"type": "object", "properties": {
                "n": {"type": "integer", "minimum": 1, "maximum": 99}}, "required": ["n"]}}},
        {"id": "regex", "text": "pick", "sampling_params": {"max_new_tokens": 20, "regex": "(left|right)[!?]"}},
        {"id": "bad_regex", "input_ids": [7], "sampling_params": {"regex": "(unclosed"}},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    dst = tmp_path / "out.jsonl"
    # In this process: the console script's own main (test_generate_dp2_matches_dp1 spawns it as a process)
    argv = ["generate", "--model", tiny_llama, "--input", str(src), "--output", str(dst), "--max-total-tokens", "2048"]
    assert cli_in_process(argv) == 1  # three lines were bad
    assert "3 request(s) failed" in capsys.readouterr().err
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    by_id = {}
    for row in out:
        by_id.setdefault(row["id"], []).append(row)
    with Engine(EngineConfig(model_path=tiny_llama, max_total_tokens=2048)) as engine:
        ref = engine.generate([GenerateRequest("a", [5, 9, 33, 70], SamplingParams(max_new_tokens=6, temperature=0))])
    assert by_id["a"][0]["output_ids"] == ref[0].sequences[0].output_ids
    assert by_id["a"][0]["finish_reason"]["type"] in ("length", "stop")
    b = by_id["b"][0]
    assert len(b["logprobs"]) == len(b["output_ids"]) and len(b["top_logprobs"][0]) == 2
    assert isinstance(b["text"], str) and b["prompt_tokens"] > 0
    assert sorted(r["index"] for r in by_id["c"]) == [0, 1]
    assert "temperature" in by_id["bad"][0]["error"]
    assert "temprature" in by_id["unknown"][0]["error"]
    assert 1 <= json.loads(by_id["json"][0]["text"])["n"] <= 99
    assert by_id["regex"][0]["text"] in ("left!", "left?", "right!", "right?")
    assert by_id["bad_regex"][0]["error"].startswith("regex: invalid regular expression")


@pytest.mark.e2e
def test_generate_dp2_matches_dp1(tiny_llama, tmp_path):
    """--dp-size 2: the same greedy lines as one engine, in input order, with an n > 1 line kept together."""
    lines = [{"id": i, "input_ids": [5 + i, 9, 33, 70 - i], "sampling_params": {"max_new_tokens": 5,
                                                                                 "temperature": 0}}
             for i in range(5)]
    lines.append({"id": "n", "input_ids": [7, 8], "sampling_params": {"max_new_tokens": 4, "temperature": 0.9,
                                                                      "seed": 3, "n": 2}})
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    outputs = []
    for dp in ("1", "2"):  # dp 1 in this process (the entry point's own path); dp 2 spawns its replica processes
        dst = tmp_path / f"out{dp}.jsonl"
        argv = ["generate", "--model", tiny_llama, "--input", str(src), "--output", str(dst), "--max-total-tokens",
                "1024", "--dp-size", dp, "--load-balance-method", "shortest_queue"]
        if dp == "1":
            assert cli_in_process(argv) == 0
        else:
            proc = subprocess.run([sys.executable, "-m", "tandem.common.cli", *argv], capture_output=True, text=True,
                                  timeout=120)
            assert proc.returncode == 0, proc.stderr
        outputs.append([(r["id"], r["index"], r["output_ids"]) for r in map(json.loads, dst.read_text().splitlines())])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 7


@pytest.mark.e2e
def test_the_readmes_offline_pipe_runs_as_written(tiny_llama):
    """README's `echo ... | tandem generate --input - --output -`, the model given as TANDEM_MODEL."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    command = next(line for b in re.findall(r"```bash\n(.*?)```", readme, re.S) for line in b.splitlines()
                   if "| tandem generate" in line)
    command = command.replace("| tandem ", f"| {sys.executable} -m tandem.common.cli ")
    done = subprocess.run(["bash", "-ec", command], env={**os.environ, "TANDEM_MODEL": tiny_llama},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.splitlines()
    out = json.loads(line)
    assert out["id"] == 1 and out["completion_tokens"] > 0 and "error" not in out
