"""Constrained decoding across prefill/decode: the prefill samples the first token under the grammar, the decode
advances its own matcher with that token and continues; greedy output equals the unified engine's."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tandem.common.tokenizer import load_tokenizer
from tests.services.pd_helpers import PDPair, output_ids

pytestmark = pytest.mark.e2e

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "size": {"type": "integer", "minimum": 10, "maximum": 99}},
          "required": ["name", "size"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{2,5} [0-9]{1,3}"
EBNF = 'root ::= "[" item ("," item)? "]"\nitem ::= "x" | "yy" | [0-9]'
NO_WHITESPACE = "--constrained-json-disable-any-whitespace"
CASES = [({"json_schema": json.dumps(SCHEMA)}, [11, 12, 13]), ({"regex": REGEX}, [21, 22]),
         ({"ebnf": EBNF}, list(range(30, 90))), ({"json_schema": json.dumps(SCHEMA)}, list(range(100, 160)))]
PROTO_FIELD = {"json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf_grammar"}


@pytest.fixture(scope="module")
def expected(tiny_llama):
    config = EngineConfig(model_path=tiny_llama, max_total_tokens=4096, page_size=4, chunked_prefill_size=48,
                          max_context_len=1024, constrained_json_disable_any_whitespace=True)
    with Engine(config) as engine:
        results = engine.generate([GenerateRequest(f"e{i}", prompt, SamplingParams(
            max_new_tokens=120, temperature=0.0, **constraint)) for i, (constraint, prompt) in enumerate(CASES)])
    return [r.sequences[0].output_ids for r in results]


def check_valid(tokenizer, constraint: dict, ids: list[int]) -> None:
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if "json_schema" in constraint:
        jsonschema.validate(json.loads(text), SCHEMA)
    elif "regex" in constraint:
        assert re.fullmatch(REGEX, text), text
    else:
        assert re.fullmatch(r"\[(x|yy|[0-9])(,(x|yy|[0-9]))?\]", text), text


@pytest.mark.parametrize("prefill_loop, decode_loop", [("overlap", "normal"), ("normal", "overlap")])
def test_pd_constrained_greedy_equals_unified_and_is_valid(tiny_llama, expected, prefill_loop, decode_loop):
    """Both event loops on each side; an invalid constraint fails both legs with INVALID_ARGUMENT; nothing leaks."""
    tokenizer = load_tokenizer(tiny_llama).tokenizer
    pair = PDPair(tiny_llama, NO_WHITESPACE, prefill_extra=("--event-loop", prefill_loop),
                  decode_extra=("--event-loop", decode_loop))
    try:
        reqs = []
        for i, (constraint, prompt) in enumerate(CASES):
            (kind, text), = constraint.items()
            reqs.append(pair.request(f"c{i}", prompt, max_new_tokens=120, **{PROTO_FIELD[kind]: text}))
        for (p_resp, d_resp), want, (constraint, _) in zip(pair.run_legs(reqs), expected, CASES):
            assert output_ids(d_resp) == want
            assert output_ids(p_resp) == want[:1]  # the first token was sampled under the grammar on the prefill
            assert [r.complete for r in d_resp if r.HasField("complete")][0].finish_reason == "stop"
            check_valid(tokenizer, constraint, want)
        bad = pair.request("bad", [5, 6, 7], json_schema='{"type": "object", "properties": 3}')
        for stub in (pair.p_stub, pair.d_stub):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(bad, timeout=30))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "json_schema: invalid JSON schema" in err.value.details()
        # Embeddings: the prefill computes them; the decode refuses, naming where to send them.
        embed = pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]))
        assert pair.p_stub.Embed(embed).embedding_dim == 64
        with pytest.raises(grpc.RpcError) as err:
            pair.d_stub.Embed(embed)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED and "unified or prefill" in err.value.details()
        pair.wait_both_free()
    finally:
        pair.close()
