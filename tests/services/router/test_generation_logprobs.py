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


def test_a_stop_string_ends_at_the_same_token_whatever_the_chunking(tiny_llama):
    """A stop string matched inside a multi-token delta ends the sequence at the token that completed it: the
    text, the tokens counted for usage and the logprobs are those of one-token deltas (the unfaulted stream and a
    migrated one chunk differently)."""
    assets = load_tokenizer_assets(tiny_llama)
    ids = list(range(40, 80))
    text = assets.tokenizer.decode(ids)
    stop = next(text[i:i + 3] for i in range(len(text) // 2, len(text) - 3)
                if text[i:i + 3].strip() and text.find(text[i:i + 3]) == i)

    def run(chunk: int):
        spec = GenerationSpec(kind="completion", model=None, prompt="hi", logprobs=1,
                              sampling=SamplingOptions(max_tokens=len(ids), ignore_eos=True, stop=[stop]))
        seq = SequenceText(0, assets, spec)
        pieces, logprobs = [], []
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            out = seq.on_delta(TokenDelta(0, part, logprobs=[-1.0] * len(part)))
            if out is not None:
                pieces.append(out.text)
                logprobs += out.logprobs
            if seq.finished:
                break
        return "".join(pieces), seq.tokens, len(logprobs), seq.finished

    one = run(1)
    assert one[3] and one[1] < len(ids) and one[2] == one[1] and stop not in one[0]
    for chunk in (2, 3, 7, len(ids)):
        assert run(chunk) == one, chunk


def test_a_stop_string_in_the_workers_last_delta_counts_only_the_tokens_up_to_it(tiny_llama):
    """The worker's final delta (a length end, with its own completion count) holds the stop string's match: usage
    counts the tokens up to the one that completed it, as when the same tokens stream one at a time."""
    import asyncio

    from tandem.services.router.generation import TextGenerator
    from tandem.services.router.messages import Usage

    assets = load_tokenizer_assets(tiny_llama)
    ids = list(range(40, 80))
    text = assets.tokenizer.decode(ids)
    stop = next(text[i:i + 3] for i in range(len(text) // 2, len(text) - 3)
                if text[i:i + 3].strip() and text.find(text[i:i + 3]) == i)

    class Worker:
        def __init__(self, chunk: int):
            self.chunk = chunk

        async def generate(self, req):
            for start in range(0, len(ids), self.chunk):
                last = start + self.chunk >= len(ids)
                yield TokenDelta(0, ids[start:start + self.chunk], finished=last,
                                 finish_reason="length" if last else None, completion_tokens=len(ids) if last else 0)

    def usage_for(chunk: int) -> tuple[int, str, str]:
        spec = GenerationSpec(kind="completion", model=None, prompt="hi",
                              sampling=SamplingOptions(max_tokens=len(ids), ignore_eos=True, stop=[stop]))
        generator = TextGenerator(lambda: assets, Worker(chunk), lambda: 1024)
        req = generator.prepare(spec)

        async def collect():
            usage = Usage()
            deltas = [d async for d in generator.stream(spec, req, usage)]
            return usage.completion_tokens, "".join(d.text for d in deltas), deltas[-1].finish_reason

        return asyncio.run(collect())

    one = usage_for(1)
    assert one[0] < len(ids) and one[2] == "stop" and stop not in one[1]
    assert usage_for(len(ids)) == one  # one delta, the last: the match is in it
    assert usage_for(len(ids) // 2 + 1) == one
