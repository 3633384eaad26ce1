"""DecodeGraphRunner: bucket padding, compiled decode equal to eager, padded rows never touching real KV, flags."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from tandem.common.config import (ConfigError, EngineConfig, add_engine_args, default_batch_sizes,
                                  engine_config_from_args)
from tandem.common.model.graph_runner import BATCH_TENSORS, SCRATCH_SLOT, DecodeGraphRunner
from tandem.common.model.loader import load_model


def test_default_buckets_per_device():
    assert default_batch_sizes("cpu", 64) == [1, 2, 4, 8, 16, 32, 64]
    assert default_batch_sizes("cpu", 48) == [1, 2, 4, 8, 16, 32, 48]
    assert default_batch_sizes("cuda", 32) == [1, 2, 4, 8, 16, 24, 32]
    assert default_batch_sizes("cpu", 1) == [1]


def test_flags_parse_and_choose_the_buckets(tiny_llama):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", tiny_llama, "--enable-torch-compile", "--cuda-graph-bs", "8,1,2"])
    config = engine_config_from_args(args)
    assert config.decode_graphs and config.graph_batch_sizes() == [1, 2, 8]
    args = parser.parse_args(["--model", tiny_llama, "--cuda-graph-max-bs", "12", "--device", "cuda"])
    config = engine_config_from_args(args)
    assert config.decode_graphs and config.graph_batch_sizes() == [1, 2, 4, 8, 12]
    assert not engine_config_from_args(parser.parse_args(["--model", tiny_llama])).decode_graphs  # CPU default
    args = parser.parse_args(["--model", tiny_llama, "--enable-torch-compile", "--disable-cuda-graph"])
    assert not engine_config_from_args(args).decode_graphs
    with pytest.raises(ConfigError, match="--cuda-graph-bs"):
        engine_config_from_args(parser.parse_args(["--model", tiny_llama, "--cuda-graph-bs", "0,2"]))
    # Every CUDA backend plans a graph's decode (the AttentionBackend graph hooks).
    for backend in ("torch", "triton", "flashinfer"):
        assert EngineConfig(device="cuda", attention_backend=backend).decode_graphs
    assert not EngineConfig(device="cuda", attention_backend="triton", disable_cuda_graph=True).decode_graphs
    with pytest.raises(ConfigError, match="--cuda-graph-max-bs"):
        EngineConfig(model_path=tiny_llama, cuda_graph_max_bs=0).validate()


def _decode_batch(paged_runner, config, model, prompts, kv_dtype=None):
    """A runner holding `prompts` in its pool, and the decode ForwardBatch of their next tokens (planned)."""
    runner = paged_runner(config, model, page_size=4, pool_tokens=256, max_reqs=8, kv_dtype=kv_dtype)
    runner.extend({i: p for i, p in enumerate(prompts)}, all_logits=False)
    captured = {}
    forward = model.forward
    model.forward = lambda fb: captured.setdefault("fb", fb) and forward(fb)
    try:
        runner.decode({i: 7 + i for i in range(len(prompts))})
    finally:
        model.forward = forward
    return runner, captured["fb"]


def test_bucket_padding_points_padded_rows_at_the_scratch_slot(tiny_llama, paged_runner):
    config, model = load_model(tiny_llama, "float32", "cpu", "torch")
    runner, fb = _decode_batch(paged_runner, config, model, [[5, 6, 7], [8, 9, 10, 11, 12]])
    graphs = DecodeGraphRunner(model, runner.req_pool, runner.kv_pool, [1, 4], "cpu")
    assert graphs.bucket_for(2) == 4 and graphs.bucket_for(1) == 1 and graphs.bucket_for(5) is None
    padded = graphs.pad(fb)
    assert padded.batch_size == 4 and padded.seq_lens_cpu == fb.seq_lens_cpu + [1, 1]
    assert padded.out_cache_loc.tolist() == fb.out_cache_loc.tolist() + [SCRATCH_SLOT] * 2
    assert padded.input_ids[2:].tolist() == [0, 0] and padded.positions[2:].tolist() == [0, 0]
    assert fb.batch_size == 2 and fb.out_cache_loc.numel() == 2  # the scheduler's batch is untouched
    # A compiled bucket guards on its inputs' dispatch keys: every batch reaches it with inference tensors, whether
    # the scheduler built them inside inference mode or not (else each kind compiles again, past the limit).
    with torch.inference_mode():
        inference = graphs.pad(dataclasses.replace(fb, positions=fb.positions.clone()))
    plain = dataclasses.replace(fb, **{name: torch.zeros_like(getattr(fb, name)) for name in BATCH_TENSORS})
    for batch in (padded, inference, graphs.pad(plain), graphs.pad(dataclasses.replace(plain, batch_size=1))):
        assert all(getattr(batch, name).is_inference() for name in BATCH_TENSORS)
    fb.logits_indices = torch.arange(2)
    assert graphs.pad(fb) is None  # input logprobs run eagerly


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_compiled_decode_matches_eager_and_leaves_real_kv_alone(tiny_llama, paged_runner, kv_dtype):
    """Two identical pools (the model's dtype, or FP8): one decodes eagerly, the other through the bucket-4 graph
    with 3 real rows. Logits agree, and every pool row but the new tokens' and the scratch slot is bit-identical
    afterwards."""
    config, model = load_model(tiny_llama, "float32", "cpu", "torch")
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
    eager_runner, eager_fb = _decode_batch(paged_runner, config, model, prompts, kv_dtype)
    graph_runner, graph_fb = _decode_batch(paged_runner, config, model, prompts, kv_dtype)
    before = [b.clone() for b in graph_runner.kv_pool.k_buffers + graph_runner.kv_pool.v_buffers]
    graphs = DecodeGraphRunner(model, graph_runner.req_pool, graph_runner.kv_pool, [4], "cpu")
    padded = graphs.pad(graph_fb)
    model.attn_backend.init_forward_metadata(padded)
    logits = graphs.forward(padded)[: graph_fb.batch_size]

    model.attn_backend.init_forward_metadata(eager_fb)
    expected = model(eager_fb)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert logits.argmax(-1).tolist() == expected.argmax(-1).tolist()

    written = set(graph_fb.out_cache_loc.tolist()) | {SCRATCH_SLOT}
    untouched = [r for r in range(before[0].shape[0]) if r not in written]
    after = graph_runner.kv_pool.k_buffers + graph_runner.kv_pool.v_buffers
    for old, new, eager in zip(before, after, eager_runner.kv_pool.k_buffers + eager_runner.kv_pool.v_buffers):
        assert torch.equal(old[untouched].view(torch.uint8), new[untouched].view(torch.uint8))
        real = graph_fb.out_cache_loc
        torch.testing.assert_close(new[real].float(), eager[eager_fb.out_cache_loc].float(), rtol=1e-5, atol=1e-5)
