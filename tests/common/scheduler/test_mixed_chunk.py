"""--enable-mixed-chunk: a prefill (chunk) carries the running requests' decode step in one forward. Outputs stay
HF's greedy ids and prompt logprobs in both loops, constrained rows stay valid, aborts and retraction free
everything, and the flag is refused where no engine both prefills and decodes."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import jsonschema
import pytest

from tandem.common.config import ConfigError, EngineConfig
from tandem.common.engine import Engine
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tests.common.scheduler.hf_reference import hf_greedy, hf_prompt_logprobs
from tests.common.scheduler.test_constrained_decoding import SCHEMA, assert_no_leak, text_of, tokenizer  # noqa: F401
from tests.common.scheduler.test_engine_parity import make_prompts, run_engine

MIXED = dict(enable_mixed_chunk=True, chunked_prefill_size=64, page_size=4)


@pytest.fixture(scope="module", params=["normal", "overlap"])
def engine(request, tiny_llama):
    config = EngineConfig(model_path=tiny_llama, max_total_tokens=8192, max_context_len=1024,
                          event_loop=request.param, profile_steps=True, constrained_json_disable_any_whitespace=True,
                          **MIXED)
    with Engine(config) as eng:
        yield eng


def mixed_steps(engine: Engine) -> int:
    return engine.step_profiler.report().get("mixed", {}).get("steps", 0)


def wait_running(engine: Engine, count: int) -> None:
    """Until `count` requests decode (their prompts and grammars are done)."""
    deadline = time.monotonic() + 30
    while engine.memory_report()["running"] < count:
        assert time.monotonic() < deadline, engine.memory_report()
        time.sleep(0.005)


def greedy(max_new: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True, **kw)


def test_greedy_ids_and_prompt_logprobs_match_hf(engine, tiny_llama):
    """Short prompts decode while the long ones are prefilled chunk by chunk in the same forwards; one long prompt
    asks for its prompt logprobs, computed in steps that also decode the others."""
    prompts = [p for p in make_prompts(512, seed=3) if len(p) <= 300]
    scored = list(range(40, 230))  # three chunks of 64
    before = mixed_steps(engine)
    reqs = [GenerateRequest(f"m{i}", p, greedy(10), return_logprob=True) for i, p in enumerate(prompts)]
    reqs.append(GenerateRequest("scored", scored, greedy(4), return_logprob=True, logprob_start_len=0))
    results = engine.generate(reqs)
    assert mixed_steps(engine) > before + 3
    for prompt, result in zip(prompts, results):
        ref_ids, ref_lps = hf_greedy(tiny_llama, prompt, 10)
        seq = result.sequences[0]
        assert seq.output_ids == ref_ids, f"prompt of {len(prompt)} tokens diverged"
        assert max(abs(a - b) for a, b in zip(seq.logprobs, ref_lps)) < 1e-4
    seq = results[-1].sequences[0]
    assert seq.output_ids == hf_greedy(tiny_llama, scored, 4)[0]
    assert seq.input_logprobs[0] is None and len(seq.input_logprobs) == len(scored)
    assert max(abs(a - b) for a, b in zip(seq.input_logprobs[1:], hf_prompt_logprobs(tiny_llama, scored))) < 1e-4
    assert_no_leak(engine)


def test_constrained_rows_decode_inside_mixed_steps(engine, tokenizer):  # noqa: F811
    """JSON-schema rows (greedy and sampled) decode while long prompts are prefilled in the same forwards: the
    grammar mask of a mixed step covers the decode rows and the new prompts' first tokens alike."""
    constrained = [engine.submit(GenerateRequest(engine.new_rid(), [5 + i, 40, 41 + 3 * i], SamplingParams(
        max_new_tokens=160, temperature=0.0 if i % 2 else 1.0, seed=i, json_schema=json.dumps(SCHEMA))))
        for i in range(4)]
    wait_running(engine, 4)
    before = mixed_steps(engine)
    long = [engine.submit(GenerateRequest(engine.new_rid(), list(range(30 + i, 330 + i)), greedy(3)))
            for i in range(3)]
    for handle in constrained:
        seq = handle.result().sequences[0]
        jsonschema.validate(json.loads(text_of(tokenizer, seq.output_ids)), SCHEMA)
    assert all(h.result().sequences[0].finish_reason.kind == "length" for h in long)
    assert mixed_steps(engine) > before
    assert_no_leak(engine)


def test_abort_during_mixed_steps_frees_everything(engine):
    """A decoding request aborted while a long prompt's chunks carry its steps, and that prompt aborted while it
    is being chunked: both end, and every page and slot returns."""
    decoding = engine.submit(GenerateRequest("dec", list(range(10, 40)), greedy(900)))
    wait_running(engine, 1)
    long = engine.submit(GenerateRequest("long", [8 + i % 500 for i in range(600)], greedy(400)))
    deadline = time.monotonic() + 30
    while engine.memory_report()["chunked"] == 0:  # the long prompt is being chunked
        assert time.monotonic() < deadline
        time.sleep(0.005)
    engine.abort("dec")
    engine.abort("long")
    for handle in (decoding, long):
        seq = handle.result().sequences[0]
        assert seq.finish_reason.kind == "abort" and len(seq.output_ids) < 400
    assert_no_leak(engine)


@pytest.mark.parametrize("event_loop", ["normal", "overlap"])
def test_retraction_keeps_outputs_exact(tiny_llama, event_loop):
    """A pool too small for every request decoding at once: mixed steps and retraction together. The prompts take
    ~10 mixed steps to prefill in 64-token chunks and every request decodes 40 tokens, so all twelve decode at
    once before the first finishes, and 640 tokens cannot hold their 588 prompt tokens (in 4-token pages) and 40
    new tokens each (1,068): a retraction follows however the requests reach the scheduler."""
    prompts = [p for p in make_prompts(512) if len(p) <= 200]
    expected = [hf_greedy(tiny_llama, p, 40)[0] for p in prompts]
    overrides = dict(MIXED, max_total_tokens=640, event_loop=event_loop, init_new_token_ratio=0.01,
                     min_new_token_ratio=0.01)
    results, stats = run_engine(tiny_llama, prompts, overrides, max_new=40)
    assert [r.sequences[0].output_ids for r in results] == expected
    assert stats["num_retractions"] > 0


@pytest.mark.e2e
def test_refused_where_prefill_and_decode_are_apart(tiny_llama):
    config = EngineConfig(model_path=tiny_llama, enable_mixed_chunk=True).validate()
    with pytest.raises(ConfigError, match="a decode worker does only one"):
        config.check_role("decode")
    assert EngineConfig(model_path=tiny_llama).validate().check_role("prefill")
    # The worker command says so before it loads anything.
    proc = subprocess.run([sys.executable, "-m", "tandem.common.cli", "prefill", "--model", tiny_llama, "--port", "0",
                           "--enable-mixed-chunk"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--enable-mixed-chunk mixes prefills into decode steps: a prefill worker" in proc.stderr
