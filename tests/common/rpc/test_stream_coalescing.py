"""A Generate stream whose consumer fell behind the scheduler sends each sequence's queued tokens as one chunk, and
the chunks and the completion still add up to exactly what the scheduler produced."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tandem.common.engine import Engine, RequestHandle
from tandem.common.rpc.request_telemetry import RequestTelemetry
from tandem.common.rpc.servicer import SchedulerServicer
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import FinishReason, GenerateRequest, TokenOutput, coalesce
from tandem.common.telemetry.tracing import NOOP_TRACE


def outputs_of(rid: str, steps: list[list[tuple[int, int]]], logprobs: bool = False) -> list[list[TokenOutput]]:
    """Per scheduler step, (index, token) outputs; the last step finishes every sequence."""
    counts: dict[int, int] = {}
    out = []
    for s, step in enumerate(steps):
        batch = []
        for index, token in step:
            counts[index] = counts.get(index, 0) + 1
            last = s == len(steps) - 1
            batch.append(TokenOutput(rid, index, [token], logprobs=[-token / 8] if logprobs else None,
                                     top_logprobs=[[(token, -token / 8)]] if logprobs else None,
                                     finished=last, finish_reason=FinishReason("length") if last else None,
                                     prompt_tokens=5, completion_tokens=counts[index]))
        out.append(batch)
    return out


def test_coalesce_keeps_each_sequence_in_order_with_the_latest_ending():
    steps = outputs_of("r", [[(0, 10), (1, 20)], [(0, 11), (1, 21)], [(0, 12), (1, 22)]], logprobs=True)
    merged = coalesce([o for step in steps for o in step])
    assert [(m.index, m.token_ids) for m in merged] == [(0, [10, 11, 12]), (1, [20, 21, 22])]
    assert merged[0].logprobs == [-10 / 8, -11 / 8, -12 / 8]
    assert merged[1].top_logprobs == [[(20, -20 / 8)], [(21, -21 / 8)], [(22, -22 / 8)]]
    assert all(m.finished and m.finish_reason.kind == "length" and m.completion_tokens == 3 for m in merged)


class _Context:
    def invocation_metadata(self):
        return ()

    def set_trailing_metadata(self, metadata):
        self.trailing = metadata

    async def abort(self, code, details, trailing_metadata=()):
        raise AssertionError(f"unexpected abort {code}: {details}")


def _stream(handle: RequestHandle, req: GenerateRequest) -> list[pb.GenerateResponse]:
    servicer = SchedulerServicer.__new__(SchedulerServicer)  # stream_responses needs the weight version ...
    servicer.engine = SimpleNamespace(control=SimpleNamespace(weight_version="default"))
    servicer.stream_interval = 1  # ... and --stream-interval (the default: every step)

    async def collect():
        telemetry = RequestTelemetry(NOOP_TRACE, None, req.sampling_params.n)
        return [r async for r in servicer.stream_responses(req.rid, req, handle, _Context(), telemetry)]
    return asyncio.run(collect()) if handle.loop is None else handle.loop.run_until_complete(collect())


def test_a_consumer_behind_the_scheduler_gets_one_chunk_per_sequence():
    loop = asyncio.new_event_loop()
    try:
        req = GenerateRequest("behind", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=4, n=2), stream=True)
        handle = RequestHandle(req.rid, 2, loop)
        engine = Engine.__new__(Engine)  # only its delivery: the handles and their lock
        engine._handles, engine._lock = {req.rid: handle}, threading.Lock()
        steps = outputs_of(req.rid, [[(0, 10), (1, 20)], [(0, 11), (1, 21)], [(0, 12), (1, 22)], [(0, 13), (1, 23)]])
        scheduler = threading.Thread(target=lambda: [engine.deliver(step) for step in steps])
        scheduler.start()  # all four steps are delivered before the stream's consumer first runs
        scheduler.join()
        responses = _stream(handle, req)
    finally:
        loop.close()
    chunks = [r.chunk for r in responses if r.HasField("chunk")]
    completes = {r.complete.index: r.complete for r in responses if r.HasField("complete")}
    assert [(c.index, list(c.token_ids), c.completion_tokens) for c in chunks] == [(0, [10, 11, 12, 13], 4),
                                                                                  (1, [20, 21, 22, 23], 4)]
    assert {i: list(c.output_ids) for i, c in completes.items()} == {0: [10, 11, 12, 13], 1: [20, 21, 22, 23]}
    assert engine._handles == {}  # both sequences finished: the engine forgot the request


def test_a_consumer_that_keeps_up_gets_a_chunk_per_step():
    loop = asyncio.new_event_loop()
    try:
        req = GenerateRequest("live", [1, 2, 3], SamplingParams(max_new_tokens=3), stream=True)
        handle = RequestHandle(req.rid, 1, loop)
        steps = outputs_of(req.rid, [[(0, 7)], [(0, 8)], [(0, 9)]])

        async def feed():
            for step in steps:
                await asyncio.sleep(0.01)  # the consumer drains each step before the next arrives
                for out in step:
                    handle.put_on_loop(out)
        feeder = loop.create_task(feed())
        responses = _stream(handle, req)
        loop.run_until_complete(feeder)
    finally:
        loop.close()
    assert [list(r.chunk.token_ids) for r in responses if r.HasField("chunk")] == [[7], [8], [9]]
    assert [list(r.complete.output_ids) for r in responses if r.HasField("complete")] == [[7, 8, 9]]
