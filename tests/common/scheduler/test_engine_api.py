"""Engine behaviour a caller relies on: validation, abort, n>1, seeds, stops, logprobs, no leaks."""

from __future__ import annotations

import threading
import time

import pytest

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.errors import InvalidRequestError
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tests.common.scheduler.hf_reference import hf_greedy, hf_prompt_logprobs, hf_prompt_top_logprobs


@pytest.fixture(scope="module")
def engine(tiny_llama):
    config = EngineConfig(model_path=tiny_llama, max_total_tokens=8192, page_size=4,
                          chunked_prefill_size=64, max_context_len=1024)
    with Engine(config) as eng:
        yield eng


def assert_no_leak(engine: Engine) -> None:
    deadline = time.monotonic() + 10
    while True:
        report = engine.memory_report()
        if report["running"] == 0 and report["waiting"] == 0:
            break
        assert time.monotonic() < deadline, report
        time.sleep(0.05)
    assert report["leaked_tokens"] == 0, report
    assert report["protected_tokens"] == 0, report
    assert report["free_req_slots"] == report["total_req_slots"], report


def greedy(max_new: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, **kw)


@pytest.mark.parametrize("ids, params, field", [
    ([], greedy(), "input_ids"),
    ([5] * 1024, greedy(), "input_ids"),
    ([5] * 1000, greedy(max_new=100), "max_new_tokens"),
    ([5, 10**6], greedy(), "input_ids"),
    ([5, -1], greedy(), "input_ids"),
    ([5], SamplingParams(temperature=-1.0), "temperature"),
    ([5], SamplingParams(top_p=0.0), "top_p"),
    ([5], SamplingParams(top_p=1.5), "top_p"),
    ([5], SamplingParams(top_k=-5), "top_k"),
    ([5], SamplingParams(min_p=2.0), "min_p"),
    ([5], SamplingParams(max_new_tokens=-1), "max_new_tokens"),
    ([5], SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
    ([5], SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
])
def test_bad_input_names_the_field(engine, ids, params, field):
    with pytest.raises(InvalidRequestError) as info:
        engine.submit(GenerateRequest(engine.new_rid(), ids, params))
    assert info.value.field == field
    assert field.split("_")[0] in str(info.value)
    assert_no_leak(engine)


def test_abort_running_request_frees_everything(engine):
    handle = engine.submit(GenerateRequest("long", list(range(10, 60)), greedy(max_new=900, ignore_eos=True)))
    first = next(iter(handle))
    assert first.token_ids
    engine.abort("long")
    outs = [first] + list(handle)
    assert outs[-1].finished and outs[-1].finish_reason.kind == "abort"
    assert sum(len(o.token_ids) for o in outs) < 900
    assert_no_leak(engine)


def test_abort_waiting_request(engine):
    # Fill the running set so the last request waits, then abort it before it runs.
    handles = [engine.submit(GenerateRequest(f"w{i}", list(range(10, 200)), greedy(max_new=200, ignore_eos=True)))
               for i in range(3)]
    engine.abort("w2")
    results = [h.result() for h in handles]
    assert results[2].sequences[0].finish_reason.kind in ("abort",)
    assert all(r.sequences[0].finish_reason.kind == "length" for r in results[:2])
    assert_no_leak(engine)


def test_n_samples_share_the_prompt_and_seed_reproduces(engine):
    prompt = list(range(20, 120))
    params = SamplingParams(max_new_tokens=10, temperature=1.0, n=3, seed=1234, ignore_eos=True)
    a = engine.generate([GenerateRequest("n-a", prompt, params)])[0]
    b = engine.generate([GenerateRequest("n-b", prompt, params)])[0]
    assert len(a.sequences) == 3
    assert [s.output_ids for s in a.sequences] == [s.output_ids for s in b.sequences]
    assert len({tuple(s.output_ids) for s in a.sequences}) > 1  # the siblings sample independently
    assert b.cached_tokens >= 96  # the second request reused the first one's prompt pages
    other = engine.generate([GenerateRequest("n-c", prompt, SamplingParams(
        max_new_tokens=10, temperature=1.0, n=3, seed=99, ignore_eos=True))])[0]
    assert [s.output_ids for s in other.sequences] != [s.output_ids for s in a.sequences]
    assert_no_leak(engine)


def test_stop_token_and_min_new_tokens(engine, tiny_llama):
    prompt = list(range(30, 70))
    ref, _ = hf_greedy(tiny_llama, prompt, 8)
    stop = ref[3]
    first_stop = ref.index(stop)
    out = engine.generate([GenerateRequest("stop", prompt, greedy(max_new=8, stop_token_ids=[stop]))])[0]
    seq = out.sequences[0]
    assert seq.output_ids == ref[: first_stop + 1]
    assert seq.finish_reason.kind == "stop" and seq.finish_reason.matched == stop
    # With min_new_tokens the stop token is masked until enough tokens exist.
    out = engine.generate([GenerateRequest("min", prompt, greedy(max_new=8, stop_token_ids=[stop],
                                                                 min_new_tokens=8))])[0]
    assert len(out.sequences[0].output_ids) == 8 and stop not in out.sequences[0].output_ids
    assert_no_leak(engine)


def test_prompt_logprobs_match_hf(engine, tiny_llama):
    prompt = list(range(40, 190))  # longer than one chunk (64): logprobs are stitched across chunks
    ref = hf_prompt_logprobs(tiny_llama, prompt)
    out = engine.generate([GenerateRequest("ilp", prompt, greedy(max_new=2), return_logprob=True,
                                           top_logprobs_num=3, logprob_start_len=0)])[0]
    seq = out.sequences[0]
    assert seq.input_logprobs[0] is None and len(seq.input_logprobs) == len(prompt)
    assert max(abs(a - b) for a, b in zip(seq.input_logprobs[1:], ref)) < 1e-4
    assert len(seq.top_logprobs) == 2 and all(len(row) == 3 for row in seq.top_logprobs)
    assert seq.top_logprobs[0][0][0] == seq.output_ids[0]  # greedy picks the most likely token
    assert_no_leak(engine)


def assert_top_rows_match(rows: list[list[tuple[int, float]]], ref: list[list[tuple[int, float]]]) -> None:
    """Same alternatives with the same values; ids compared as sets where two values tie within float noise."""
    assert len(rows) == len(ref)
    for row, want in zip(rows, ref):
        assert len(row) == len(want)
        assert max(abs(a[1] - b[1]) for a, b in zip(row, want)) < 1e-4
        ids = {t for t, v in row if v > want[-1][1] + 1e-4}
        assert ids <= {t for t, _ in want}


def test_prompt_top_logprobs_match_hf(engine, tiny_llama):
    """SGLang's input_top_logprobs: every prompt position's top-k alternatives, stitched across chunks (64)."""
    prompt = list(range(200, 330))
    out = engine.generate([GenerateRequest("itop", prompt, greedy(max_new=1), return_logprob=True,
                                           top_logprobs_num=5, logprob_start_len=0)])[0]
    seq = out.sequences[0]
    assert len(seq.input_top_logprobs) == len(prompt) and seq.input_top_logprobs[0] == []
    assert_top_rows_match(seq.input_top_logprobs[1:], hf_prompt_top_logprobs(tiny_llama, prompt, 5))
    # The prompt token's own logprob is one of its row's values when it ranks in the top k.
    for pos in range(1, len(prompt)):
        row = dict(seq.input_top_logprobs[pos])
        if prompt[pos] in row:
            assert abs(row[prompt[pos]] - seq.input_logprobs[pos]) < 1e-5
    assert_no_leak(engine)


def test_scoring_only_returns_prompt_logprobs(engine, tiny_llama):
    """max_new_tokens 0 with logprob_start_len 0: lm-eval's loglikelihood shape, no token generated."""
    prompt = list(range(450, 480))
    out = engine.generate([GenerateRequest("score", prompt, greedy(max_new=0), return_logprob=True,
                                           top_logprobs_num=1, logprob_start_len=0)])[0]
    seq = out.sequences[0]
    assert seq.output_ids == [] and seq.finish_reason.kind == "length"
    assert max(abs(a - b) for a, b in zip(seq.input_logprobs[1:], hf_prompt_logprobs(tiny_llama, prompt))) < 1e-4
    assert_top_rows_match(seq.input_top_logprobs[1:], hf_prompt_top_logprobs(tiny_llama, prompt, 1))
    assert_no_leak(engine)


def test_max_new_tokens_zero_only_prefills(engine):
    out = engine.generate([GenerateRequest("zero", list(range(10, 40)), greedy(max_new=0))])[0]
    assert out.sequences[0].output_ids == [] and out.sequences[0].finish_reason.kind == "length"
    assert_no_leak(engine)


def test_streaming_chunks_add_up(engine):
    handle = engine.submit(GenerateRequest("stream", list(range(10, 30)), greedy(max_new=16, ignore_eos=True)))
    chunks = list(handle)
    assert len(chunks) >= 2 and chunks[-1].finished
    assert sum(len(c.token_ids) for c in chunks) == 16
    assert chunks[-1].completion_tokens == 16 and chunks[-1].prompt_tokens == 20


def test_a_scheduler_crash_fails_requests_instead_of_hanging(tiny_llama):
    with Engine(EngineConfig(model_path=tiny_llama, max_total_tokens=1024, event_loop="normal")) as engine:
        def broken(work):
            raise RuntimeError("injected fault")
        engine.worker.run = broken
        handle = engine.submit(GenerateRequest("crash", [5, 6, 7], greedy(max_new=4)))
        outs = list(handle)
        assert outs[-1].finished and outs[-1].error.grpc_code == "INTERNAL" and "injected fault" in outs[-1].error.message
        with pytest.raises(RuntimeError, match="crashed"):
            engine.stats()
        with pytest.raises(RuntimeError, match="crashed"):
            engine.submit(GenerateRequest("after", [5], greedy()))


def test_a_scheduler_crash_fails_requests_still_in_its_inbox(tiny_llama):
    with Engine(EngineConfig(model_path=tiny_llama, max_total_tokens=1024, event_loop="normal")) as engine:
        queued = []

        def broken(work):
            # Submitted after the loop drained its inbox, so it sits there when the loop dies.
            queued.append(engine.submit(GenerateRequest("queued", [8, 9], greedy(max_new=2, n=2))))
            raise RuntimeError("injected fault")
        engine.worker.run = broken
        first = engine.submit(GenerateRequest("crash", [5, 6, 7], greedy(max_new=4)))
        assert list(first)[-1].error.grpc_code == "INTERNAL"
        outs: list = []
        reader = threading.Thread(target=lambda: outs.extend(queued[0]), daemon=True)
        reader.start()
        reader.join(10)
        assert not reader.is_alive(), "a request left in the inbox of a crashed scheduler hangs its caller"
        ends = [o for o in outs if o.finished]
        assert len(ends) == 2 and all(o.error.grpc_code == "INTERNAL" for o in ends)


def test_a_failing_control_call_fails_its_caller_not_the_scheduler(engine):
    with pytest.raises(ZeroDivisionError):
        engine.call(lambda s: 1 / 0)
    out = engine.generate([GenerateRequest("after-call", [5, 6, 7], greedy(max_new=3))])[0]
    assert out.completion_tokens == 3
    assert_no_leak(engine)
