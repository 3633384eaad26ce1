"""Constrained decoding (xgrammar) in the unified scheduler, both event loops: the tiny model is random, so every
valid output below is valid by construction; invalid constraints fail before any KV; nothing leaks."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.errors import InvalidRequestError
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tandem.common.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "kind": {"enum": ["cat", "dog", "eel"]},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
                   "ok": {"type": "boolean"}},
    "required": ["id", "kind", "tags", "ok"],
    "additionalProperties": False,
}
REGEX = r"(red|green|blue)-[0-9]{2,4}(\.[a-z]{1,3})?"
EBNF = 'root ::= "(" expr ")"\nexpr ::= num | num ("+" | "*") num\nnum ::= [1-9] [0-9]?'
EBNF_MATCH = re.compile(r"\([1-9][0-9]?([+*][1-9][0-9]?)?\)")


@pytest.fixture(scope="module", params=["normal", "overlap"])
def engine(request, tiny_llama):
    config = EngineConfig(model_path=tiny_llama, max_total_tokens=8192, page_size=4, chunked_prefill_size=64,
                          max_context_len=1024, event_loop=request.param,
                          constrained_json_disable_any_whitespace=True)
    with Engine(config) as eng:
        yield eng


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(tiny_llama).tokenizer


def assert_no_leak(engine: Engine) -> None:
    deadline = time.monotonic() + 10
    while True:
        report = engine.memory_report()
        if not any(report[q] for q in ("running", "waiting", "grammar", "chunked")):
            break
        assert time.monotonic() < deadline, report
        time.sleep(0.05)
    assert report["leaked_tokens"] == 0 and report["protected_tokens"] == 0, report
    assert report["free_req_slots"] == report["total_req_slots"], report
    assert report["live_grammars"] == 0, report


def text_of(tokenizer, output_ids: list[int]) -> str:
    return tokenizer.decode(output_ids, skip_special_tokens=True)


def requests(engine, constraint: dict, count: int, max_new: int = 160, **kw) -> list[GenerateRequest]:
    """Greedy and seeded sampled rows, different prompts: one batch where constrained rows differ."""
    return [GenerateRequest(engine.new_rid(), [5 + i, 40, 41 + 3 * i], SamplingParams(
        max_new_tokens=max_new, temperature=0.0 if i % 2 else 1.0, seed=i, **constraint, **kw)) for i in range(count)]


def test_json_schema_outputs_validate(engine, tokenizer):
    results = engine.generate(requests(engine, {"json_schema": json.dumps(SCHEMA)}, 6))
    for result in results:
        seq = result.sequences[0]
        assert seq.finish_reason.kind == "stop", seq
        jsonschema.validate(json.loads(text_of(tokenizer, seq.output_ids)), SCHEMA)
    assert len({tuple(r.sequences[0].output_ids) for r in results}) > 1
    assert_no_leak(engine)


def test_any_json_regex_and_ebnf(engine, tokenizer):
    batch = (requests(engine, {"regex": REGEX}, 4) + requests(engine, {"ebnf": EBNF}, 4)
             + requests(engine, {"json_schema": "$$ANY$$"}, 2, max_new=300))
    results = engine.generate(batch)
    for result in results[:4]:
        assert re.fullmatch(REGEX, text_of(tokenizer, result.sequences[0].output_ids)), result
    for result in results[4:8]:
        assert EBNF_MATCH.fullmatch(text_of(tokenizer, result.sequences[0].output_ids)), result
    for result in results[8:]:
        if result.sequences[0].finish_reason.kind == "stop":
            json.loads(text_of(tokenizer, result.sequences[0].output_ids))
    assert all(r.sequences[0].finish_reason.kind == "stop" for r in results[:8])
    assert_no_leak(engine)


def test_mixed_batch_leaves_unconstrained_rows_alone(engine):
    """A row without a constraint samples exactly what it samples alone, next to constrained rows."""
    plain = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    alone = engine.generate([GenerateRequest(engine.new_rid(), [7, 8, 9], plain)])[0]
    mixed = engine.generate(requests(engine, {"regex": REGEX}, 3)
                            + [GenerateRequest(engine.new_rid(), [7, 8, 9], plain)])[-1]
    assert mixed.sequences[0].output_ids == alone.sequences[0].output_ids
    assert_no_leak(engine)


def test_grammar_end_finishes_even_with_ignore_eos(engine, tokenizer):
    """ignore_eos removes EOS from the stop ids; the grammar accepting its end still ends the request."""
    out = engine.generate(requests(engine, {"regex": "(yes|no)"}, 2, ignore_eos=True))
    for result in out:
        seq = result.sequences[0]
        assert seq.finish_reason.kind == "stop"
        assert text_of(tokenizer, seq.output_ids) in ("yes", "no")
    assert_no_leak(engine)


def test_n_siblings_each_follow_the_grammar(engine, tokenizer):
    params = SamplingParams(max_new_tokens=40, temperature=1.0, n=4, seed=7, regex=REGEX)
    result = engine.generate([GenerateRequest(engine.new_rid(), [11, 12, 13], params)])[0]
    texts = [text_of(tokenizer, s.output_ids) for s in result.sequences]
    assert all(re.fullmatch(REGEX, t) for t in texts), texts
    assert len(set(texts)) > 1
    assert_no_leak(engine)


def test_structural_tag(engine, tokenizer):
    tag = {"structures": [{"begin": "<f>", "schema": {"type": "object", "properties": {"n": {"enum": [1, 2]}},
                                                        "required": ["n"]}, "end": "</f>"}],
           "triggers": ["<f>"]}
    params = SamplingParams(max_new_tokens=80, temperature=0.0, structural_tag=json.dumps(tag))
    seq = engine.generate([GenerateRequest(engine.new_rid(), [20, 21], params)])[0].sequences[0]
    for body in re.findall(r"<f>(.*?)</f>", text_of(tokenizer, seq.output_ids), re.S):
        assert json.loads(body)["n"] in (1, 2)
    assert_no_leak(engine)


@pytest.mark.parametrize("constraint, problem", [
    ({"regex": "[a-"}, "Unclosed '['"),
    ({"json_schema": "{not json"}, "json_schema: invalid JSON schema"),
    ({"json_schema": '{"type": 5}'}, "json_schema: invalid JSON schema"),
    ({"ebnf": "root ::= undefined_rule"}, 'Rule "undefined_rule" is not defined'),
    ({"structural_tag": '{"structures": 3}'}, "structural_tag: invalid structural tag"),
])
def test_invalid_constraint_fails_before_any_kv(engine, constraint, problem):
    result = engine.submit(GenerateRequest(engine.new_rid(), [5, 6], SamplingParams(max_new_tokens=8, **constraint)))
    outs = list(result)
    assert len(outs) == 1 and outs[0].finished and not outs[0].token_ids
    assert outs[0].error is not None and outs[0].error.grpc_code == "INVALID_ARGUMENT"
    assert problem in outs[0].error.message
    with pytest.raises(InvalidRequestError, match=re.escape(problem)):
        engine.compile_constraint(SamplingParams(**constraint)).result()
    assert_no_leak(engine)


def test_two_constraints_are_refused_at_submit(engine):
    with pytest.raises(InvalidRequestError) as info:
        engine.submit(GenerateRequest(engine.new_rid(), [5], SamplingParams(regex="a", json_schema="{}")))
    assert "at most one of" in str(info.value) and info.value.field == "regex"


def test_abort_frees_kv_and_grammar(engine):
    # min_new_tokens: no draw of the seeded stream can end it (EOS is masked) before the abort does
    long = SamplingParams(max_new_tokens=600, min_new_tokens=600, temperature=1.0, seed=3, regex="[a-z ]{1,2000}")
    handle = engine.submit(GenerateRequest("gram-abort", [9, 10, 11], long))
    first = next(iter(handle))
    engine.abort("gram-abort")
    outs = [first] + list(handle)
    assert outs[-1].finish_reason.kind == "abort"
    assert_no_leak(engine)


def test_normal_and_overlap_agree(tiny_llama, engine, tokenizer):
    """The overlap loop fills step N+1's mask only after step N's token advanced each matcher: its greedy and
    seeded outputs equal the normal loop's."""
    other = "normal" if engine.config.event_loop == "overlap" else "overlap"
    config = EngineConfig(model_path=tiny_llama, max_total_tokens=8192, page_size=4, max_context_len=1024,
                          event_loop=other, constrained_json_disable_any_whitespace=True)
    batch = lambda eng: requests(eng, {"json_schema": json.dumps(SCHEMA)}, 4) + requests(eng, {"regex": REGEX}, 2)  # noqa: E731
    ours = [r.sequences[0].output_ids for r in engine.generate(batch(engine))]
    with Engine(config) as eng:
        theirs = [r.sequences[0].output_ids for r in eng.generate(batch(eng))]
    assert ours == theirs
