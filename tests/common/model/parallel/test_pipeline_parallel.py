"""Pipeline parallelism: an engine at --pp-size 2 (and 4) gives the single-process engine's greedy ids (logprobs
within float noise) for Llama and Qwen3 shapes, in the pipelined and the normal loop, with chunked prefill, radix
hits, retraction and aborts, and frees every page; a dead stage fails the engine fast; what is not built is refused."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.flags import ConfigError
from tandem.common.model.config import ModelConfig
from tandem.common.model.parallel.stages import PipelineStage, check_pp_size, stage_layer_counts
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tandem.common.scheduler.schedule_batch import ScheduleBatch
from tests.common.scheduler.test_engine_parity import make_prompts, run_engine, shared_prefix_prompts

CASES = {
    # (arch, preset, pp_size, overrides)
    "llama-pp2-pipelined": ("llama", "tiny", 2, dict(event_loop="overlap", chunked_prefill_size=32, page_size=4)),
    "llama-pp2-normal": ("llama", "tiny", 2, dict(event_loop="normal", chunked_prefill_size=48, page_size=8)),
    "qwen3-pp2-pipelined": ("qwen3", "tiny", 2, dict(event_loop="overlap", schedule_policy="lpm", page_size=4)),
}


def _batch(model_dir: str) -> list[list[int]]:
    """Prompts of many lengths plus shared-prefix prompts, twice: the second round hits the radix cache."""
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    prompts = [p for p in make_prompts(vocab) if len(p) <= 300][::2]
    shared = shared_prefix_prompts(vocab)[:3]
    return prompts + shared + prompts[::-1] + shared


def _assert_same(results, reference, what: str) -> None:
    for i, (got, want) in enumerate(zip(results, reference)):
        assert got.sequences[0].output_ids == want.sequences[0].output_ids, f"{what}: request {i} diverged"
        diff = max(abs(a - b) for a, b in zip(got.sequences[0].logprobs, want.sequences[0].logprobs))
        assert diff < 1e-4, f"{what}: request {i} logprobs differ by {diff}"


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_greedy_matches_single_process(model_factory, case):
    arch, preset, pp, overrides = CASES[case]
    model_dir = model_factory(arch, preset)
    batch = _batch(model_dir)
    reference, _ = run_engine(model_dir, batch, dict(overrides, num_threads=1), logprobs=True, rounds=2)
    results, stats = run_engine(model_dir, batch, dict(overrides, pp_size=pp, num_threads=1), logprobs=True,
                                rounds=2)
    _assert_same(results, reference, case)
    assert stats["cache_hit_tokens"] >= 3 * 148
    assert all(r.cached_tokens >= 148 for r in results[-3:])


@pytest.mark.e2e
def test_pp4_over_eight_layers_matches_single_process(model_factory):
    model_dir = model_factory("llama", "small")
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    prompts = [p for p in make_prompts(vocab) if len(p) <= 120][:6]
    overrides = dict(chunked_prefill_size=64, page_size=4, num_threads=1, max_total_tokens=4096)
    reference, _ = run_engine(model_dir, prompts, overrides, logprobs=True)
    results, _ = run_engine(model_dir, prompts, dict(overrides, pp_size=4), logprobs=True)
    _assert_same(results, reference, "pp4")


@pytest.mark.e2e
@pytest.mark.parametrize("mixed", [False, True], ids=["plain", "mixed-chunk"])
def test_pipelined_retraction_keeps_outputs_exact(model_factory, mixed):
    """A 640-token pool cannot hold twelve requests decoding at once: decode micro-batches retract. With mixed
    chunks (the normal loop) every request decodes 40 tokens, so all of them are still decoding when the prompts
    are in."""
    model_dir = model_factory("llama")
    prompts = [p for p in make_prompts(512) if len(p) <= 200]
    overrides = dict(max_total_tokens=640, page_size=4, init_new_token_ratio=0.01, min_new_token_ratio=0.01,
                     chunked_prefill_size=64 if mixed else 256, num_threads=1)
    max_new = 40 if mixed else 12
    if mixed:
        overrides["event_loop"] = "normal"
    reference, _ = run_engine(model_dir, prompts, overrides, max_new=max_new)
    results, stats = run_engine(model_dir, prompts, dict(overrides, pp_size=2, enable_mixed_chunk=mixed),
                                max_new=max_new)
    assert [r.sequences[0].output_ids for r in results] == [r.sequences[0].output_ids for r in reference]
    assert stats["num_retractions"] > 0


@pytest.mark.e2e
def test_mixed_chunks_in_the_normal_loop_keep_outputs_exact(tiny_llama, monkeypatch):
    """--enable-mixed-chunk at --pp-size 2 in the normal loop (one micro-batch through the stages at a time, mixed as
    in one process): the ids of the single process without mixing, logprobs within float noise, steps really
    mixed. The pipelined loop refuses the flag, saying why."""
    prompts = [p for p in make_prompts(512) if len(p) <= 300]
    overrides = dict(event_loop="normal", chunked_prefill_size=32, page_size=4, num_threads=1)
    reference, _ = run_engine(tiny_llama, prompts, overrides, logprobs=True)
    mixed_rows = []
    mix = ScheduleBatch.mix
    monkeypatch.setattr(ScheduleBatch, "mix", lambda batch, decode: (mixed_rows.append(len(decode)), mix(batch, decode)))
    results, _ = run_engine(tiny_llama, prompts, dict(overrides, pp_size=2, enable_mixed_chunk=True), logprobs=True)
    _assert_same(results, reference, "pp2 mixed, normal loop")
    assert len(mixed_rows) >= 3 and sum(mixed_rows) >= 10, mixed_rows
    with pytest.raises(ConfigError, match="--enable-mixed-chunk with --pp-size > 1 needs --event-loop normal"):
        EngineConfig(model_path=tiny_llama, pp_size=2, enable_mixed_chunk=True).validate()


@pytest.mark.e2e
def test_aborts_in_flight_free_every_page(tiny_llama):
    params = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
    with Engine(EngineConfig(model_path=tiny_llama, pp_size=2, num_threads=1, max_total_tokens=4096,
                             chunked_prefill_size=16, page_size=4)) as engine:
        handles = [engine.submit(GenerateRequest(f"a{i}", list(range(10, 60 + 7 * i)), params)) for i in range(4)]
        for i, handle in enumerate(handles):
            next(iter(handle))  # running (or at least prefilled): its pages are allocated on every stage
            engine.abort(f"a{i}")
        results = [h.result() for h in handles]
        assert all(0 < r.completion_tokens < 200 for r in results)
        assert all(r.sequences[0].finish_reason.kind == "abort" for r in results)
        deadline = time.monotonic() + 10
        while any(engine.scheduler.queue_sizes().values()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert engine.flush_cache()
        memory = engine.memory_report()
    assert memory["leaked_tokens"] == 0 and memory["free_tokens"] == memory["total_tokens"], memory
    assert memory["free_req_slots"] == memory["total_req_slots"], memory


@pytest.mark.e2e
def test_a_dead_stage_fails_the_engine_fast(tiny_llama):
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    engine = Engine(EngineConfig(model_path=tiny_llama, pp_size=2, num_threads=1, max_total_tokens=2048,
                                 dist_timeout=6))
    try:
        assert engine.generate([GenerateRequest("ok", [5, 6, 7], params)])[0].completion_tokens == 4
        (stage1,) = engine.pp_launch.processes
        os.kill(stage1.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while engine.fatal is None:
            assert time.monotonic() < deadline, "the engine did not notice its dead stage"
            time.sleep(0.05)
        assert "pipeline stage 1 exited" in engine.fatal
        with pytest.raises(RuntimeError, match="pipeline stage 1 exited"):
            engine.submit(GenerateRequest("late", [5, 6, 7], params))
    finally:
        engine.shutdown()


def test_layer_split_gives_the_remainder_to_the_stages_before_the_last():
    assert stage_layer_counts(8, 4) == [2, 2, 2, 2]
    assert stage_layer_counts(10, 4) == [2, 3, 3, 2]
    assert stage_layer_counts(7, 4) == [2, 2, 2, 1]
    assert stage_layer_counts(2, 2) == [1, 1]
    config = ModelConfig("LlamaForCausalLM", "llama", vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_layers=10, num_heads=2, num_kv_heads=1, head_dim=8)
    assert [PipelineStage(s, 4).layers(config) for s in range(4)] == [range(0, 2), range(2, 5), range(5, 8),
                                                                      range(8, 10)]
    with pytest.raises(ConfigError, match="--pp-size 16 cannot split this model: it has 10 layers"):
        check_pp_size(config, 16)


@pytest.mark.parametrize("overrides,words", [
    (dict(tp_size=2, nnodes=2, dist_init_addr="127.0.0.1:1"), "a pipeline's ranks spanning nodes"),
    (dict(lora_paths=["a={adapter}"]), "LoRA adapters on a pipeline"),
    (dict(enable_torch_compile=True), "--enable-torch-compile with --pp-size 2"),
])
def test_what_a_pipeline_does_not_support_is_refused_at_start_up(tiny_llama, tmp_path, overrides, words):
    for name in ("adapter_config.json", "adapter_model.safetensors"):  # an adapter directory as the flag checks it
        (tmp_path / name).write_text("{}")
    overrides = {k: [v[0].format(adapter=tmp_path)] if k == "lora_paths" else v for k, v in overrides.items()}
    with pytest.raises(ConfigError, match=words):
        EngineConfig(model_path=tiny_llama, pp_size=2, **overrides).validate()


def test_prefill_and_decode_refuse_pipeline_parallelism(tiny_llama):
    with pytest.raises(ConfigError, match="pipeline parallelism on a prefill or decode worker is not implemented"):
        Engine(EngineConfig(model_path=tiny_llama, pp_size=2), scheduler_factory=lambda parts: None)
