"""Greedy parity with HuggingFace transformers across scheduling scenarios, and no leaked KV after."""

from __future__ import annotations

import random

import pytest

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tests.common.scheduler.hf_reference import hf_greedy

PROMPT_LENS = [1, 2, 3, 5, 8, 13, 17, 31, 64, 100, 128, 200, 256, 300, 384, 450]
MAX_NEW = 12


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, vocab) for _ in range(n)] for n in PROMPT_LENS]


def shared_prefix_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    prefix = [rng.randrange(8, vocab) for _ in range(150)]
    return [prefix + [rng.randrange(8, vocab) for _ in range(rng.randrange(1, 40))] for _ in range(8)]


def run_engine(model_dir: str, prompts, config_overrides: dict, one_by_one: bool = False,
               logprobs: bool = False, rounds: int = 1, inspect=None, max_new: int = MAX_NEW):
    """inspect(engine), when given, runs after the requests, before the engine closes (to check one that costs
    processes to start without starting another)."""
    config = EngineConfig(model_path=model_dir, **config_overrides)
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    with Engine(config) as engine:
        reqs = [GenerateRequest(f"r{i}", p, params, return_logprob=logprobs) for i, p in enumerate(prompts)]
        if one_by_one:
            results = [engine.generate([r])[0] for r in reqs]
        else:
            size = len(reqs) // rounds
            results = [res for k in range(rounds) for res in engine.generate(reqs[k * size:(k + 1) * size])]
        stats = engine.stats()
        if inspect is not None:
            inspect(engine)
        assert engine.flush_cache()
        memory = engine.memory_report()
    assert memory["leaked_tokens"] == 0 and memory["cached_tokens"] == 0, memory
    assert memory["free_tokens"] == memory["total_tokens"], memory
    assert memory["free_req_slots"] == memory["total_req_slots"], memory
    return results, stats


SCENARIOS = {
    "batch_of_one": (dict(), True),
    "all_at_once": (dict(), False),
    "tiny_chunks": (dict(chunked_prefill_size=32, page_size=4), False),
    "page_size_1": (dict(page_size=1), False),
    "normal_loop": (dict(event_loop="normal"), False),
    "normal_loop_chunked": (dict(event_loop="normal", chunked_prefill_size=48, page_size=8), False),
    "lpm_policy": (dict(schedule_policy="lpm"), False),
    "no_radix": (dict(disable_radix_cache=True), False),
    "mixed_chunk": (dict(enable_mixed_chunk=True, chunked_prefill_size=64, page_size=4), False),
}


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral"])
def arch_model(request, model_factory):
    model_dir = model_factory(request.param)
    from tandem.common.model.config import ModelConfig

    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    prompts = make_prompts(vocab)
    expected = [hf_greedy(model_dir, p, MAX_NEW) for p in prompts]
    return model_dir, vocab, prompts, expected


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_hf(arch_model, scenario):
    model_dir, _, prompts, expected = arch_model
    overrides, one_by_one = SCENARIOS[scenario]
    results, _ = run_engine(model_dir, prompts, overrides, one_by_one, logprobs=True)
    for prompt, result, (ref_ids, ref_lps) in zip(prompts, results, expected):
        seq = result.sequences[0]
        assert seq.output_ids == ref_ids, f"prompt of {len(prompt)} tokens diverged"
        assert seq.finish_reason.kind == "length"
        assert max(abs(a - b) for a, b in zip(seq.logprobs, ref_lps)) < 1e-4


def test_shared_prefixes_hit_the_radix_cache(arch_model):
    model_dir, vocab, _, _ = arch_model
    prompts = shared_prefix_prompts(vocab)
    expected = [hf_greedy(model_dir, p, MAX_NEW)[0] for p in prompts]
    config = dict(page_size=4)
    results, stats = run_engine(model_dir, prompts + prompts, config, rounds=2)
    assert [r.sequences[0].output_ids for r in results] == expected + expected
    # The 150-token prefix is computed once; the second round hits almost everything.
    assert stats["cache_hit_tokens"] >= 7 * 148
    assert any(r.cached_tokens >= 148 for r in results[8:])


@pytest.mark.parametrize("event_loop", ["normal", "overlap"])
def test_retraction_keeps_outputs_exact(arch_model, event_loop):
    model_dir, _, prompts, expected = arch_model
    # Room for the prompts but not for all of them decoding at once: the scheduler must retract.
    overrides = dict(max_total_tokens=640, page_size=4, event_loop=event_loop,
                     init_new_token_ratio=0.01, min_new_token_ratio=0.01, chunked_prefill_size=256)
    subset = [p for p in prompts if len(p) <= 200]
    results, stats = run_engine(model_dir, subset, overrides)
    ref = [e for p, e in zip(prompts, expected) if len(p) <= 200]
    assert [r.sequences[0].output_ids for r in results] == [e[0] for e in ref]
    assert stats["num_retractions"] > 0
