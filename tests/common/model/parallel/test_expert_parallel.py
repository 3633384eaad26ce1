"""Expert parallelism (`--ep-size`): each rank holds its share of every MoE layer's experts (and, with
--tp-size > --ep-size, a slice of each expert's columns); greedy ids equal the single-process engine's in both
event loops with chunked prefill and radix hits, every page free after; EPLB moves experts between ranks while
requests run without changing a token; `tandem generate --ep-size 2` runs it."""

from __future__ import annotations

import json
import random

import pytest

from tandem.common.model.config import ModelConfig
from tests.common.rpc.helpers import cli_in_process
from tests.common.scheduler.test_engine_parity import make_prompts, run_engine, shared_prefix_prompts

pytestmark = pytest.mark.e2e

LOOPS = {
    "overlap": dict(event_loop="overlap", chunked_prefill_size=32, page_size=4),
    "normal": dict(event_loop="normal", chunked_prefill_size=48, page_size=8),
}


def _two_rounds(vocab: int) -> list[list[int]]:
    prompts = [p for p in make_prompts(vocab) if len(p) <= 120][:4]
    shared = shared_prefix_prompts(vocab)[:2]
    return prompts[:2] + shared + prompts[2:] + shared


def _ids(results) -> list[list[int]]:
    return [r.sequences[0].output_ids for r in results]


def _close(a, b) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra.sequences[0].logprobs, rb.sequences[0].logprobs))


@pytest.mark.parametrize("arch, parallel", [
    ("qwen3_moe", dict(tp_size=2, ep_size=2)),   # experts split, each whole
    ("mixtral", dict(tp_size=2, ep_size=1)),     # every expert's columns split (moe tp 2)
    ("qwen2_moe", dict(tp_size=4, ep_size=2)),   # both, and the shared expert split 4 ways
])
@pytest.mark.parametrize("loop", list(LOOPS))
def test_expert_parallel_greedy_matches_single_process(model_factory, arch, parallel, loop):
    path = model_factory(arch)
    batch = _two_rounds(ModelConfig.from_pretrained(path).vocab_size)
    overrides = dict(LOOPS[loop], num_threads=1, max_total_tokens=4096)
    reference, _ = run_engine(path, batch, overrides, logprobs=True, rounds=2)
    seen = {}

    def inspect(engine) -> None:
        seen.update(memory=engine.rank_memory, location=engine.experts.location)

    # run_engine asserts every page and request slot is free again after the flush.
    results, stats = run_engine(path, batch, dict(overrides, **parallel), logprobs=True, rounds=2, inspect=inspect)
    assert _ids(results) == _ids(reference)
    assert _close(results, reference) < 1e-4
    assert stats["cache_hit_tokens"] > 0
    weights = [m.weight_bytes for m in seen["memory"]]
    assert len(weights) == parallel["tp_size"] and len(set(weights)) == 1  # equal shares
    assert seen["location"].ep_size == parallel["ep_size"]


def _skewed_prompts(vocab: int, count: int = 8) -> list[list[int]]:
    """Mostly three token ids: the router sends most tokens to the same few experts."""
    rng = random.Random(0)
    hot = [rng.randrange(8, vocab) for _ in range(3)]
    return [[rng.choice(hot) if rng.random() < 0.8 else rng.randrange(8, vocab)
             for _ in range(rng.randrange(20, 60))] for _ in range(count)]


@pytest.mark.parametrize("redundant", [0, 2])
def test_eplb_moves_experts_mid_request_without_changing_a_token(model_factory, redundant):
    path = model_factory("qwen2_moe")
    prompts = _skewed_prompts(ModelConfig.from_pretrained(path).vocab_size)
    base = dict(num_threads=1, max_total_tokens=4096, page_size=4)
    reference, _ = run_engine(path, prompts, base, logprobs=True, max_new=24)
    seen = {}

    def inspect(engine) -> None:
        seen.update(rebalances=list(engine.experts.rebalances), location=engine.experts.location)

    eplb = dict(base, tp_size=2, ep_size=2, enable_eplb=True, eplb_rebalance_num_iterations=3,
                ep_num_redundant_experts=redundant)
    results, _ = run_engine(path, prompts, eplb, logprobs=True, max_new=24, inspect=inspect)
    assert _ids(results) == _ids(reference)
    assert _close(results, reference) < 1e-4
    assert seen["rebalances"], "no rebalance happened: the test proves nothing"
    assert all(r["imbalance_after"] < r["imbalance_before"] for r in seen["rebalances"])
    table = seen["location"].physical_to_logical
    assert table.shape == (2, 8 + redundant)
    assert table.tolist() != [list(range(8)) + list(range(redundant))] * 2  # the experts did move


def test_generate_cli_with_ep_size_matches_single_process(model_factory, tmp_path):
    path = model_factory("qwen3_moe")
    prompts = make_prompts(ModelConfig.from_pretrained(path).vocab_size)[:3]
    reference, _ = run_engine(path, prompts, dict(num_threads=1), max_new=10)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": i, "input_ids": p, "sampling_params": {
        "max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}) + "\n" for i, p in enumerate(prompts)))
    assert cli_in_process(["generate", "--model", path, "--input", str(src), "--output", str(dst),
                           "--ep-size", "2", "--num-threads", "1"]) == 0
    rows = sorted((json.loads(line) for line in dst.read_text().splitlines()), key=lambda r: r["id"])
    assert [r["output_ids"] for r in rows] == _ids(reference)


def test_pipeline_stages_of_expert_parallel_groups_match_single_process(model_factory):
    """--pp-size 2 --tp-size 2 --ep-size 2 (four processes): each stage's EP group holds its layers' experts; the
    recorder, which would see one stage's layers only, is refused there."""
    from tandem.common.control.experts import ExpertsUnavailable

    path = model_factory("qwen2_moe")
    prompts = make_prompts(ModelConfig.from_pretrained(path).vocab_size)[:4]
    reference, _ = run_engine(path, prompts, dict(num_threads=1))
    refused = []

    def inspect(engine) -> None:
        with pytest.raises(ExpertsUnavailable, match="--pp-size > 1") as err:
            engine.experts.start_record()
        refused.append(str(err.value))

    results, _ = run_engine(path, prompts, dict(num_threads=1, pp_size=2, tp_size=2, ep_size=2), inspect=inspect)
    assert _ids(results) == _ids(reference) and refused
