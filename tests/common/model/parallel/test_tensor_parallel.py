"""Tensor parallelism: an engine at --tp-size 2 (two processes, gloo) gives HF's greedy ids and logprobs for Llama,
Qwen2 and Qwen3 shapes across both event loops, chunked prefill (mixed with decode steps), radix hits and retraction,
and frees every page."""

from __future__ import annotations

import pytest

from tandem.common.flags import ConfigError
from tandem.common.model.config import ModelConfig
from tandem.common.model.parallel.layers import TPShard, check_tp_size, local_config
from tests.common.scheduler.hf_reference import hf_greedy
from tests.common.scheduler.test_engine_parity import MAX_NEW, make_prompts, run_engine, shared_prefix_prompts

# arch -> engine overrides; each case is one two-process engine.
CASES = {
    "llama": dict(event_loop="overlap", chunked_prefill_size=32, page_size=4, enable_mixed_chunk=True),
    "qwen2": dict(event_loop="normal", chunked_prefill_size=48, page_size=8),
    "qwen3": dict(event_loop="overlap", schedule_policy="lpm", page_size=4),
}


@pytest.mark.e2e
@pytest.mark.parametrize("arch", list(CASES))
def test_tp2_greedy_matches_hf(model_factory, arch):
    model_dir = model_factory(arch)
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    prompts = [p for p in make_prompts(vocab) if len(p) <= 300]
    shared = shared_prefix_prompts(vocab)[:3]
    # Two rounds of prompts of many lengths and the same shared-prefix prompts: round 2 hits the radix cache.
    batch = prompts[0::3] + shared + prompts[1::3] + shared
    expected = [hf_greedy(model_dir, p, MAX_NEW) for p in batch]
    results, stats = run_engine(model_dir, batch, dict(CASES[arch], tp_size=2, num_threads=1), logprobs=True,
                                rounds=2)
    for prompt, result, (ref_ids, ref_lps) in zip(batch, results, expected):
        seq = result.sequences[0]
        assert seq.output_ids == ref_ids, f"{arch}: prompt of {len(prompt)} tokens diverged"
        assert max(abs(a - b) for a, b in zip(seq.logprobs, ref_lps)) < 1e-4
    assert stats["cache_hit_tokens"] >= 3 * 148
    assert all(r.cached_tokens >= 148 for r in results[-3:])


@pytest.mark.e2e
@pytest.mark.parametrize("event_loop", ["normal", "overlap"])
def test_tp2_retraction_keeps_outputs_exact(model_factory, event_loop):
    model_dir = model_factory("llama")
    prompts = [p for p in make_prompts(512) if len(p) <= 200]
    expected = [hf_greedy(model_dir, p, MAX_NEW)[0] for p in prompts]
    overrides = dict(max_total_tokens=640, page_size=4, event_loop=event_loop, init_new_token_ratio=0.01,
                     min_new_token_ratio=0.01, chunked_prefill_size=256, tp_size=2, num_threads=1)
    results, stats = run_engine(model_dir, prompts, overrides)
    assert [r.sequences[0].output_ids for r in results] == expected
    assert stats["num_retractions"] > 0


def _config(heads: int, kv_heads: int, inter: int = 128) -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", "llama", vocab_size=509, hidden_size=64, intermediate_size=inter,
                       num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=16)


def test_shards_cover_every_head_once_and_replicate_scarce_kv_heads():
    config = _config(8, 2)
    shards = [TPShard(r, 4) for r in range(4)]
    assert [list(s.q_heads(config)) for s in shards] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # 2 KV heads over 4 ranks: each rank holds the head its q heads read (q head h reads kv head h // 4).
    assert [list(s.kv_heads(config)) for s in shards] == [[0], [0], [1], [1]]
    # 509 rows: 128 per rank, the last rank's tail padding.
    assert [(s.vocab(config).start, s.vocab(config).stop) for s in shards] == [(0, 128), (128, 256), (256, 384),
                                                                                (384, 509)]
    local = local_config(config, shards[3])
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (2, 1, 32, 128)


@pytest.mark.parametrize("heads,kv_heads,inter,tp,words", [
    (6, 2, 128, 4, "num_attention_heads (6)"),
    (8, 3, 128, 2, "num_key_value_heads (3)"),
    (8, 2, 100, 8, "intermediate_size (100)"),
])
def test_unshardable_models_are_refused_at_start_up(heads, kv_heads, inter, tp, words):
    with pytest.raises(ConfigError, match=rf"--tp-size {tp} cannot shard this model: .*{words}".replace("(", r"\(")
                       .replace(")", r"\)")):
        check_tp_size(_config(heads, kv_heads, inter), tp)
