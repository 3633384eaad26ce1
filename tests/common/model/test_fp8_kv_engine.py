"""--kv-cache-dtype fp8 end to end: every CPU-testable backend's greedy run on an FP8 KV cache against the torch
backend's on the same FP8 cache, in both loops; the checkpoint's scales reach the pool; the pool holds twice the
tokens of a bf16 one in the same memory."""

from __future__ import annotations

import logging
import os
import shutil

import pytest

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports the kernels (see test_triton_attention)

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from tandem.common import engine as engine_module  # noqa: E402
from tandem.common.config import EngineConfig  # noqa: E402
from tandem.common.engine import kv_pool_tokens  # noqa: E402
from tandem.common.memory.kv_pool import kv_bytes_per_token  # noqa: E402
from tests.common.model.conftest import generate_prefix_sharing  # noqa: E402

def _generate(model_dir: str, **overrides):
    sequences, _, pool = generate_prefix_sharing(model_dir, seed=5, dtype="float32", **overrides)
    return sequences, pool


@pytest.fixture(scope="module")
def torch_fp8_reference(tiny_llama):
    return _generate(tiny_llama, attention_backend="torch", event_loop="normal", kv_cache_dtype="fp8_e4m3")[0]


@pytest.mark.parametrize("backend,event_loop", [("cpu", "normal"), ("cpu", "overlap"), ("triton", "overlap")])
def test_greedy_on_fp8_kv_matches_torch_backend_on_fp8_kv(tiny_llama, torch_fp8_reference, backend, event_loop):
    got, pool = _generate(tiny_llama, attention_backend=backend, event_loop=event_loop, kv_cache_dtype="fp8")
    assert pool.k_buffers[0].dtype == torch.float8_e4m3fn and pool.k_scales == [1.0] * len(pool.k_buffers)
    for seq, ref in zip(got, torch_fp8_reference):
        assert seq.output_ids == ref.output_ids
        assert max(abs(a - b) for a, b in zip(seq.logprobs, ref.logprobs)) < 1e-4


def test_fp8_kv_changes_the_numbers_but_stays_close_to_full_precision(tiny_llama, torch_fp8_reference):
    full = _generate(tiny_llama, attention_backend="torch", event_loop="normal")[0]
    first_logprobs = [(a.logprobs[0], b.logprobs[0]) for a, b in zip(torch_fp8_reference, full)]
    assert any(a != b for a, b in first_logprobs)  # the cache really is quantized
    assert all(abs(a - b) < 0.1 for a, b in first_logprobs)


def test_checkpoint_scales_reach_the_pool_and_are_not_unused_weights(tiny_llama, tmp_path, caplog):
    model_dir = tmp_path / "scaled"
    shutil.copytree(tiny_llama, model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    layers = sum(1 for name in tensors if name.endswith("self_attn.q_proj.weight"))
    for i in range(layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.5 + i)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.INFO):
        got, pool = _generate(str(model_dir), attention_backend="cpu", event_loop="normal",
                              kv_cache_dtype="fp8_e5m2")
    assert pool.k_buffers[0].dtype == torch.float8_e5m2
    assert pool.k_scales == [0.5 + i for i in range(layers)] and pool.v_scales == [0.25] * layers
    assert "k_scale/v_scale from the checkpoint" in caplog.text
    assert "does not use" not in caplog.text  # the loader leaves the scales to the pool
    reference, _ = _generate(str(model_dir), attention_backend="torch", event_loop="normal",
                             kv_cache_dtype="fp8_e5m2")
    assert [s.output_ids for s in got] == [s.output_ids for s in reference]


def test_an_fp8_pool_holds_twice_the_tokens_in_the_same_memory(tiny_llama, monkeypatch):
    monkeypatch.setattr(engine_module, "_available_ram", lambda: 1 << 24)
    config = EngineConfig(model_path=tiny_llama, page_size=4, mem_fraction=0.5)
    bf16 = kv_pool_tokens(config, kv_bytes_per_token(4, 2, 64, torch.bfloat16), 1 << 20)
    fp8 = kv_pool_tokens(config, kv_bytes_per_token(4, 2, 64, torch.float8_e4m3fn), 1 << 20)
    assert fp8 == 2 * bf16
