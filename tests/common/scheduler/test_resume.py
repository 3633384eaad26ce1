"""Resumed requests (request migration, worker side): a request re-issued with its first K output tokens appended
to its prompt and `resumed_output_tokens = K` continues with exactly the tokens the original produced after them,
in both event loops: greedy, seeded sampling, each kind of constraint, penalties and min_new_tokens."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.errors import InvalidRequestError
from tandem.common.rpc.resume import RESUMED_OUTPUT_TOKENS_KEY
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tandem.common.tokenizer import load_tokenizer

PROMPT = [5, 40, 41, 97, 12, 300, 7]
SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog", "eel"]}, "name": {"type": "string", "maxLength": 8},
                   "id": {"type": "integer", "minimum": 0, "maximum": 9999}},
    "required": ["kind", "name", "id"],
    "additionalProperties": False,
}
TAG = {"structures": [{"begin": "<f>", "schema": {"type": "object", "properties": {"n": {"enum": [1, 2]}},
                                                  "required": ["n"]}, "end": "</f>"}], "triggers": ["<f>"]}
SAMPLED = dict(temperature=1.0, top_p=0.9, seed=1234)
CASES = {
    "greedy": dict(temperature=0.0, max_new_tokens=24, ignore_eos=True),
    "seeded": dict(**SAMPLED, max_new_tokens=24, ignore_eos=True),
    "json_schema": dict(**SAMPLED, max_new_tokens=160, json_schema=json.dumps(SCHEMA)),
    "regex": dict(**SAMPLED, max_new_tokens=40, regex=r"(red|green|blue)-[0-9]{2,6}(\.[a-z]{1,4})?"),
    "ebnf": dict(**SAMPLED, max_new_tokens=40, ebnf='root ::= "(" expr ")"\nexpr ::= num | num ("+" | "*") expr\n'
                                                    'num ::= [1-9] [0-9]?'),
    "structural_tag": dict(temperature=0.0, max_new_tokens=40, structural_tag=json.dumps(TAG)),
    "penalties": dict(**SAMPLED, max_new_tokens=24, ignore_eos=True, repetition_penalty=1.6,
                      frequency_penalty=1.5, presence_penalty=0.5),
    "greedy_penalties": dict(temperature=0.0, max_new_tokens=24, ignore_eos=True, frequency_penalty=2.0,
                             presence_penalty=2.0),
}


@pytest.fixture(scope="module", params=["normal", "overlap"])
def engine(request, tiny_llama):
    config = EngineConfig(model_path=tiny_llama, max_total_tokens=8192, page_size=4, chunked_prefill_size=64,
                          max_context_len=1024, event_loop=request.param, constrained_json_disable_any_whitespace=True)
    with Engine(config) as eng:
        yield eng


def run(engine: Engine, prompt: list[int], params: SamplingParams, resumed: int = 0):
    req = GenerateRequest(engine.new_rid(), prompt, params, resumed_output_tokens=resumed)
    return engine.generate([req])[0].sequences[0]


def resume(engine: Engine, output: list[int], k: int, **kw):
    """The continuation of a request over PROMPT, re-issued after its first k output tokens."""
    params = SamplingParams(**{**kw, "max_new_tokens": kw["max_new_tokens"] - k})
    return run(engine, PROMPT + output[:k], params, resumed=k)


def assert_no_leak(engine: Engine) -> None:
    deadline = time.monotonic() + 10
    while any((report := engine.memory_report())[q] for q in ("running", "waiting", "grammar", "chunked")):
        assert time.monotonic() < deadline, report
        time.sleep(0.05)
    assert report["leaked_tokens"] == 0 and report["live_grammars"] == 0, report


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_resumed_request_continues_exactly(engine, case):
    kw = CASES[case]
    original = run(engine, PROMPT, SamplingParams(**kw))
    n = len(original.output_ids)
    assert n >= 8, original
    for k in (1, n // 2, n - 1):
        continued = resume(engine, original.output_ids, k, **kw)
        assert continued.output_ids == original.output_ids[k:], (case, k)
        assert continued.finish_reason.kind == original.finish_reason.kind
    assert_no_leak(engine)


def test_json_schema_continuation_validates(engine, tiny_llama):
    kw = CASES["json_schema"]
    original = run(engine, PROMPT, SamplingParams(**kw))
    assert original.finish_reason.kind == "stop"
    k = len(original.output_ids) // 2
    continued = resume(engine, original.output_ids, k, **kw)
    text = load_tokenizer(tiny_llama).tokenizer.decode(original.output_ids[:k] + continued.output_ids,
                                                        skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_resumed_output_counts_toward_min_new_tokens(engine, tiny_llama):
    # Half the vocabulary stops the request: it ends right after min_new_tokens, so a continuation that did not
    # count its resumed tokens would run min_new_tokens further.
    stops = list(range(0, 200, 2))
    kw = dict(**SAMPLED, max_new_tokens=40, min_new_tokens=12, stop_token_ids=stops)
    original = run(engine, PROMPT, SamplingParams(**kw))
    assert original.finish_reason.kind == "stop" and 12 <= len(original.output_ids) < 20, original
    for k in (1, 6, 11):
        continued = resume(engine, original.output_ids, k, **kw)
        assert continued.output_ids == original.output_ids[k:], k
    assert_no_leak(engine)


@pytest.mark.parametrize("case", ["penalties", "greedy_penalties"])
def test_a_penalty_counts_the_resumed_tokens(engine, case):
    """The same continuation with K = 0 (its resumed tokens seen as prompt) differs: the test above can fail."""
    kw = CASES[case]
    original = run(engine, PROMPT, SamplingParams(**kw))
    k = len(original.output_ids) // 2
    params = SamplingParams(**{**kw, "max_new_tokens": kw["max_new_tokens"] - k})
    as_prompt = run(engine, PROMPT + original.output_ids[:k], params, resumed=0)
    assert as_prompt.output_ids != original.output_ids[k:]


def test_output_the_grammar_refuses_is_invalid_argument(engine):
    kw = CASES["json_schema"]
    original = run(engine, PROMPT, SamplingParams(**kw))
    bad = original.output_ids[:3] + [original.output_ids[-1]]  # the stop token, before the object is complete
    handle = engine.submit(GenerateRequest(engine.new_rid(), PROMPT + bad, SamplingParams(**kw), resumed_output_tokens=4))
    outs = list(handle)
    assert outs[-1].error is not None and outs[-1].error.grpc_code == "INVALID_ARGUMENT", outs
    assert RESUMED_OUTPUT_TOKENS_KEY in outs[-1].error.message and not any(o.token_ids for o in outs)
    whole = original.output_ids  # output that already completes the constraint leaves nothing to generate
    handle = engine.submit(GenerateRequest(engine.new_rid(), PROMPT + whole, SamplingParams(**kw),
                                           resumed_output_tokens=len(whole)))
    assert "already complete" in list(handle)[-1].error.message
    assert_no_leak(engine)


@pytest.mark.parametrize("resumed, n", [(-1, 1), (len(PROMPT), 1), (2, 2)])
def test_a_bad_resumed_count_is_refused_at_submit(engine, resumed, n):
    params = SamplingParams(max_new_tokens=4, n=n, temperature=1.0)
    with pytest.raises(InvalidRequestError) as info:
        engine.submit(GenerateRequest(engine.new_rid(), PROMPT, params, resumed_output_tokens=resumed))
    assert info.value.field == RESUMED_OUTPUT_TOKENS_KEY
