"""`tandem bench peer`: its checks, the two command lines it runs, the peer's result line, the ratio; and one
real round with Tandem's offline bench against `vllm_offline.py` run on a stand-in for vLLM's offline API."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from tandem.common import cli
from tandem.common.bench import peer

# vLLM's names that vllm_offline.py calls: LLM(...).generate(prompts, SamplingParams) and inputs.TokensPrompt.
STAND_IN = {
    "vllm/__init__.py": """
        from types import SimpleNamespace

        class SamplingParams:
            def __init__(self, max_tokens, ignore_eos, temperature):
                self.max_tokens = max_tokens

        class LLM:
            def __init__(self, model, dtype, seed, max_model_len):
                assert dtype in ("float32", "bfloat16", "float16")

            def generate(self, prompts, params):
                return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7] * params.max_tokens)])
                        for _ in prompts]
    """,
    "vllm/inputs.py": """
        def TokensPrompt(prompt_token_ids):
            return {"prompt_token_ids": prompt_token_ids}
    """,
}


def parse(*argv: str):
    return cli.build_parser().parse_args(["bench", "peer", *argv])


def test_peer_python_is_required_for_vllm(tmp_path, capsys):
    assert cli.main(["bench", "peer", "--model", str(tmp_path)]) == 2
    assert "--peer-python is required for this peer" in capsys.readouterr().err


def test_unknown_peers_are_refused(tmp_path, capsys):
    assert cli.main(["bench", "peer", "--peers", "vllm,sglang", "--model", str(tmp_path)]) == 2
    assert "--peers 'vllm,sglang': a comma-separated list of vllm, llamacpp" in capsys.readouterr().err


def test_llamacpp_runs_the_same_workload_on_the_gguf_of_the_dtype():
    args = parse("--peers", "llamacpp", "--dtype", "bfloat16", "--num-prompts", "8", "--input-len", "16",
                 "--output-len", "4")
    assert args.llamacpp_python is None and peer.llamacpp_python(args) == sys.executable
    assert peer.llamacpp_command(args, "/t/model-BF16.gguf") == [
        sys.executable, str(peer.LLAMACPP_SCRIPT), "--gguf", "/t/model-BF16.gguf", "--dtype", "BF16",
        "--num-prompts", "8", "--input-len", "16", "--output-len", "4"]
    assert peer.gguf_type(parse("--dtype", "float32")) == "F32"
    assert peer.gguf_type(parse("--dtype", "bfloat16", "--gguf-type", "F16")) == "F16"


def test_a_missing_peer_python_is_an_error_naming_it(tmp_path, capsys):
    missing = str(tmp_path / "no-venv" / "python")
    assert cli.main(["bench", "peer", "--peer-python", missing, "--model", str(tmp_path)]) == 2
    assert f"--peer-python {missing}: not an executable file" in capsys.readouterr().err


def test_both_sides_run_the_same_workload():
    args = parse("--peer-python", "/venv/bin/python", "--dtype", "float32", "--num-prompts", "8",
                 "--input-len", "16", "--output-len", "4", "--tandem-args", "--page-size 32")
    ours = peer.tandem_command(args, "/m", "/tmp/o.json")
    theirs = peer.peer_command(args, "/m")
    assert ours[:4] == [sys.executable, "-m", "tandem.common.cli", "bench"]
    assert ours[4:] == ["offline", "--model", "/m", "--dtypes", "float32", "--skip-hf", "--output-json",
                        "/tmp/o.json", "--num-prompts", "8", "--input-len", "16", "--output-len", "4",
                        "--page-size", "32"]
    assert theirs == ["/venv/bin/python", str(peer.PEER_SCRIPT), "--model", "/m", "--dtype", "float32",
                      "--num-prompts", "8", "--input-len", "16", "--output-len", "4"]
    assert cli.build_parser().parse_args(ours[3:]).skip_hf  # what Tandem's side runs parses


def test_the_peer_result_is_its_last_json_line():
    out = 'INFO loading\n{"tokens_per_s": 1.0}\nWARNING spare\n{"tokens_per_s": 250.5}\n'
    assert peer.peer_tokens_per_s(out) == 250.5
    with pytest.raises(ValueError, match="no JSON result line"):
        peer.peer_tokens_per_s("Traceback ...\n")


def test_summary_is_median_and_range_of_the_ratios():
    rows = [{"vllm_ratio": 1.5}, {"vllm_ratio": 0.9}, {"vllm_ratio": 1.2}]
    assert peer.summary(rows, "vllm") == {"peer": "vllm", "median_ratio": 1.2, "min_ratio": 0.9, "max_ratio": 1.5}


@pytest.mark.e2e
def test_one_round_against_a_stand_in_for_vllm(tiny_llama, tmp_path, monkeypatch, capsys):
    for name, text in STAND_IN.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "peer.json"
    assert cli.main(["bench", "peer", "--peer-python", sys.executable, "--model", tiny_llama, "--rounds", "1",
                     "--dtype", "float32", "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
                     "--output-json", str(out)]) == 0
    (row, summary) = json.loads(out.read_text())["results"]
    assert row["tandem_tokens_per_s"] > 0 and row["vllm_tokens_per_s"] > 0
    assert row["vllm_ratio"] == pytest.approx(row["tandem_tokens_per_s"] / row["vllm_tokens_per_s"])
    assert summary == {"peer": "vllm", "median_ratio": row["vllm_ratio"], "min_ratio": row["vllm_ratio"],
                       "max_ratio": row["vllm_ratio"]}
    assert "round 0: tandem" in capsys.readouterr().out


def test_llamacpps_build_is_printed_and_kept_for_the_report(tiny_llama, tmp_path, monkeypatch, capsys):
    """The line llama.cpp's --check prints (its build's CPU features) is printed before the rounds and returned for
    --output-json's `peer_builds`; the GGUF is written once, in the run's folder."""
    info = "llama.cpp system info: CPU : AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 |"
    monkeypatch.setattr(peer, "check_llamacpp", lambda python: info)
    args = parse("--peers", "llamacpp", "--dtype", "float32", "--llamacpp-python", sys.executable)
    commands, builds, tandem_model = peer.peer_commands(args, ["llamacpp"], tiny_llama, str(tmp_path))
    assert builds == {"llamacpp": info} and info in capsys.readouterr().out
    assert commands["llamacpp"][3] == str(tmp_path / "model-F32.gguf") and os.path.isfile(commands["llamacpp"][3])
    assert tandem_model == tiny_llama  # a float file: Tandem runs the HF directory it was written from


@pytest.mark.e2e
def test_a_q4_0_run_puts_tandem_on_llamacpps_own_file(tiny_llama, tmp_path, monkeypatch):
    """--gguf-type Q4_0: one Q4_0 file for both (Tandem's activations in --dtype), so the weights are the same
    codes on each side; it is a llama.cpp-only comparison (vLLM-CPU cannot load the file), and Tandem runs it."""
    monkeypatch.setattr(peer, "check_llamacpp", lambda python: "llama.cpp system info: CPU : AVX2 = 1 |")
    args = parse("--peers", "llamacpp", "--dtype", "float32", "--gguf-type", "Q4_0", "--llamacpp-python",
                 sys.executable, "--num-prompts", "2", "--input-len", "8", "--output-len", "4")
    commands, _, tandem_model = peer.peer_commands(args, ["llamacpp"], tiny_llama, str(tmp_path))
    assert tandem_model == str(tmp_path / "model-Q4_0.gguf") == commands["llamacpp"][3]
    assert commands["llamacpp"][5] == "Q4_0"
    assert peer.run_tandem(args, tandem_model) > 0
    with pytest.raises(ValueError, match="--gguf-type Q4_0: Tandem and llama.cpp run the same quantized file"):
        peer.peer_commands(parse("--peers", "vllm,llamacpp", "--gguf-type", "Q4_0"), ["vllm", "llamacpp"],
                           tiny_llama, str(tmp_path))
