"""A masked token's -inf logprob (grammar bitmask, logit bias) reaches clients as vLLM's -9999.0: SSE chunks are
JSON, which has no -Infinity."""

from __future__ import annotations

import math

import orjson

from tandem.services.router.generation import MIN_LOGPROB, SequenceText
from tandem.services.router.messages import GenerationSpec, SamplingOptions, TokenDelta
from tandem.services.router.tokenizer import load_tokenizer_assets


def test_non_finite_logprobs_are_reported_as_the_floor(tiny_llama):
    assets = load_tokenizer_assets(tiny_llama)
    spec = GenerationSpec(kind="completion", model=None, sampling=SamplingOptions(max_tokens=4, ignore_eos=True),
                          prompt="hi", logprobs=2)
    seq = SequenceText(0, assets, spec)
    out = seq.on_delta(TokenDelta(0, [5, 6], logprobs=[-0.5, -math.inf],
                                  top_logprobs=[[(5, -0.5), (7, -math.inf)], [(6, -math.inf), (8, math.nan)]]))
    assert [e.logprob for e in out.logprobs] == [-0.5, MIN_LOGPROB]
    assert [[v for _, _, v in e.top] for e in out.logprobs] == [[-0.5, MIN_LOGPROB], [MIN_LOGPROB, MIN_LOGPROB]]
    assert orjson.loads(orjson.dumps([e.logprob for e in out.logprobs])) == [-0.5, MIN_LOGPROB]
