"""Greedy parity end to end: the engine on the Triton backend (interpreted on CPU) against the torch backend."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports the kernels (see test_triton_attention)
pytest.importorskip("triton")

from tandem.common.config import ConfigError, EngineConfig  # noqa: E402
from tandem.common.engine import Engine  # noqa: E402
from tandem.common.sampling.params import SamplingParams  # noqa: E402
from tandem.common.scheduler.io_struct import GenerateRequest  # noqa: E402
from tests.common.model.conftest import generate_prefix_sharing  # noqa: E402
from tests.common.rpc.helpers import cli_in_process  # noqa: E402


def _generate(model_dir: str, **overrides):
    sequences, stats, _ = generate_prefix_sharing(model_dir, seed=7, **overrides)
    return sequences, stats


@pytest.fixture(scope="module")
def torch_reference(tiny_llama):
    return _generate(tiny_llama, attention_backend="torch", event_loop="normal")[0]


@pytest.mark.parametrize("event_loop", ["normal", "overlap"])
def test_triton_backend_greedy_matches_torch_backend(tiny_llama, torch_reference, event_loop):
    got, stats = _generate(tiny_llama, attention_backend="triton", event_loop=event_loop)
    assert stats["cache_hit_tokens"] >= 24  # the last prompt's extend attended a prefix read from the pool
    for seq, ref in zip(got, torch_reference):
        assert seq.output_ids == ref.output_ids
        assert max(abs(a - b) for a, b in zip(seq.logprobs, ref.logprobs)) < 1e-4


def test_triton_on_cpu_needs_the_interpreter(tiny_llama, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        EngineConfig(model_path=tiny_llama, attention_backend="triton").validate()
    with pytest.raises(ConfigError, match="must be one of auto, cpu, torch, triton, flashinfer"):
        EngineConfig(model_path=tiny_llama, attention_backend="sdpa").validate()


@pytest.mark.e2e
def test_tandem_generate_with_triton_backend(tiny_llama, tmp_path, capsys):
    """docs/architecture.md's command: `TRITON_INTERPRET=1 tandem generate ... --attention-backend triton`."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "input_ids": [5, 9, 33], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}\n')
    cmd = [sys.executable, "-m", "tandem.common.cli", "generate", "--model", tiny_llama, "--input", str(src), "--output", "-",
           "--max-total-tokens", "1024", "--attention-backend"]
    proc = subprocess.run(cmd + ["triton"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr
    params = SamplingParams(max_new_tokens=4, temperature=0)
    with Engine(EngineConfig(model_path=tiny_llama, max_total_tokens=1024)) as engine:
        ref = engine.generate([GenerateRequest("1", [5, 9, 33], params)])[0].sequences[0]
    assert f'"output_ids": {ref.output_ids}' in proc.stdout
    capsys.readouterr()
    assert cli_in_process(cmd[3:] + ["flashinfer"]) == 2  # the same command, refused in this process: no Traceback
    assert "flashinfer runs FlashInfer's CUDA kernels, on --device cuda only" in capsys.readouterr().err
