"""A router that fell behind a worker's stream reads every queued message at once: each sequence's tokens become
one delta (one detokenization, one SSE chunk), in order, with logprobs, ending and failures kept."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tandem.services.router.config import RouterConfig
from tandem.services.router.dispatch import Dispatcher
from tandem.services.router.errors import ApiError
from tests.services.router.test_dispatch_pd import FakeCall, FakeRegistry, collect, make_worker, prefill_stream, \
    token_request


class BurstCall(FakeCall):
    """Every response at once, as a stream does when the router's loop was busy while they arrived."""

    async def _iterate(self):
        for response in self.responses:
            yield response  # no await between them: all are queued before the dispatcher runs again
        if self.error is not None:
            raise grpc.aio.AioRpcError(self.error, grpc.aio.Metadata(), self.trailing, details="boom")


def chunk(tokens: list[int], logprobs: list[float]) -> pb.GenerateResponse:
    lps = pb.OutputLogProbs(token_logprobs=logprobs, token_ids=tokens)
    for t, lp in zip(tokens, logprobs):
        lps.top_logprobs.add(token_ids=[t], values=[lp])
    return pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=tokens, prompt_tokens=3, output_logprobs=lps))


def dispatcher_with(decode_script) -> tuple[Dispatcher, object]:
    config = RouterConfig(workers=[], max_retries=1)
    prefill = make_worker("prefill", 1, prefill_stream, config)
    decode = make_worker("decode", 2, decode_script, config)
    return Dispatcher(FakeRegistry([prefill, decode]), config), decode


def test_queued_chunks_become_one_delta_with_every_token_and_logprob_in_order():
    def burst(request):
        done = pb.GenerateComplete(output_ids=[5, 6, 7, 8], finish_reason="length", prompt_tokens=3,
                                   completion_tokens=4)
        done.output_logprobs.CopyFrom(pb.OutputLogProbs(token_logprobs=[-0.5, -0.25, -1.0, -2.0],
                                                        token_ids=[5, 6, 7, 8]))
        for t, lp in zip([5, 6, 7, 8], [-0.5, -0.25, -1.0, -2.0]):
            done.output_logprobs.top_logprobs.add(token_ids=[t], values=[lp])
        return BurstCall([chunk([5], [-0.5]), chunk([6, 7], [-0.25, -1.0]), pb.GenerateResponse(complete=done)])

    async def main():
        dispatcher, decode = dispatcher_with(burst)
        deltas = await collect(dispatcher, token_request(return_logprob=True, top_logprobs=1))
        assert len(deltas) == 1  # chunk, chunk, and the completion's last token: one delta
        (delta,) = deltas
        assert delta.token_ids == [5, 6, 7, 8] and delta.logprobs == [-0.5, -0.25, -1.0, -2.0]
        assert delta.top_logprobs == [[(5, -0.5)], [(6, -0.25)], [(7, -1.0)], [(8, -2.0)]]
        assert delta.finished and delta.finish_reason == "length" and delta.completion_tokens == 4
        assert decode.in_flight == 0

    asyncio.run(main())


def test_tokens_queued_before_a_failure_are_delivered_and_the_request_is_not_retried():
    async def main():
        dispatcher, decode = dispatcher_with(lambda r: BurstCall([chunk([5], [-0.5]), chunk([6], [-0.5])],
                                                                 grpc.StatusCode.UNAVAILABLE))
        seen = []
        with pytest.raises(ApiError):
            async for delta in dispatcher.generate(token_request()):
                seen.append(delta)
        assert [d.token_ids for d in seen] == [[5, 6]]  # what came before the failure reached the client
        assert len(decode.stub.requests) == 1  # and, since tokens went out, no retry

    asyncio.run(main())


def test_tracker_without_logprobs_gives_empty_lists_and_fills_the_complete_from_what_was_seen():
    from tandem.services.router.legs import SequenceTracker

    tracker = SequenceTracker()
    first = tracker.to_delta(pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[5, 6], prompt_tokens=3)))
    assert (first.token_ids, first.logprobs, first.top_logprobs) == ([5, 6], [], [])
    done = tracker.to_delta(pb.GenerateResponse(complete=pb.GenerateComplete(output_ids=[5, 6, 7],
                                                                             finish_reason="length")))
    assert (done.token_ids, done.logprobs, done.finished, done.finish_reason) == ([7], [], True, "length")
