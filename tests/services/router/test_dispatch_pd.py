"""PD dispatch with stand-in workers: one GenerateRequest to both legs with the same room, tokens from decode,
prompt logprobs from prefill, a failed pair retried with a new room, the other leg aborted."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tandem.services.router.admission import Admission
from tandem.services.router.config import RouterConfig, WorkerEndpoint
from tandem.services.router.dispatch import Dispatcher
from tandem.services.router.errors import ApiError
from tandem.services.router.messages import SamplingOptions, TokenRequest
from tandem.common.roles import Role
from tandem.services.router.policies import RoundRobin, RouteRequest
from tandem.services.router.workers import Worker, WorkerLoad


class FakeCall:
    """A server-streaming call: yields `responses`, then raises `error` if given."""

    def __init__(self, responses: list, error: grpc.StatusCode | None = None, kind: str | None = None):
        self.responses = responses
        self.error = error
        self.trailing = grpc.aio.Metadata(("tandem-failure-kind", kind)) if kind else grpc.aio.Metadata()
        self.cancelled = False

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    async def _iterate(self):
        for response in self.responses:
            await asyncio.sleep(0)
            yield response
        if self.error is not None:
            raise grpc.aio.AioRpcError(self.error, grpc.aio.Metadata(), self.trailing, details="boom")

    def __aiter__(self):
        return self._iterate()


class FakeStub:
    def __init__(self, script):
        self.script = script  # request -> FakeCall
        self.requests: list[pb.GenerateRequest] = []
        self.calls: list[FakeCall] = []
        self.aborts: list[str] = []

    def Generate(self, request, timeout=None):
        self.requests.append(request)
        self.calls.append(self.script(request))
        return self.calls[-1]

    async def Abort(self, request, timeout=None):
        self.aborts.append(request.request_id)
        return pb.AbortResponse(success=True)


class FakeRegistry:
    def __init__(self, workers):
        self.workers = {w.endpoint: w for w in workers}

    def by_role(self, role, available_only=True):
        return [w for w in self.workers.values() if w.role == role and w.available()]


def make_worker(role: str, port: int, script, config: RouterConfig) -> Worker:
    worker = Worker.__new__(Worker)
    endpoint = WorkerEndpoint(role, "10.0.0.1", port, 9000 + port if role == "prefill" else None)
    Worker.__init__(worker, endpoint, config)
    worker.stub = FakeStub(script)
    worker.healthy = True
    return worker


def decode_stream(request):
    return FakeCall([
        pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[5, 6], prompt_tokens=3, cached_tokens=2)),
        pb.GenerateResponse(complete=pb.GenerateComplete(output_ids=[5, 6, 7], finish_reason="length",
                                                         prompt_tokens=3, completion_tokens=3, cached_tokens=2)),
    ])


def prefill_stream(request):
    done = pb.GenerateComplete(finish_reason="stop", prompt_tokens=3)
    for value in (None, -1.5, -0.5):
        entry = done.input_logprobs.token_logprobs.add()
        if value is not None:
            entry.value = value
    return FakeCall([pb.GenerateResponse(complete=done)])


def token_request(**kw) -> TokenRequest:
    return TokenRequest("req-1", [1, 2, 3], SamplingOptions(temperature=0.0, seed=11), max_new_tokens=3, **kw)


async def collect(dispatcher, req):
    return [d async for d in dispatcher.generate(req)]


def test_pd_sends_one_request_to_both_legs_and_merges_prompt_logprobs():
    async def main():
        config = RouterConfig(workers=[], max_retries=1)
        prefill, decode = make_worker("prefill", 1, prefill_stream, config), make_worker("decode", 2, decode_stream,
                                                                                       config)
        dispatcher = Dispatcher(FakeRegistry([prefill, decode]), config)
        deltas = await collect(dispatcher, token_request(prompt_logprobs=True))
        [p_req], [d_req] = prefill.stub.requests, decode.stub.requests
        assert p_req == d_req  # the very same GenerateRequest
        params = d_req.disaggregated_params
        assert (params.bootstrap_host, params.bootstrap_port) == ("10.0.0.1", 9001)
        assert 0 <= params.bootstrap_room < 2**31
        assert d_req.sampling_params.custom_params["seed"] == 11
        assert [t for d in deltas for t in d.token_ids] == [5, 6, 7]
        assert deltas[-1].finished and deltas[-1].finish_reason == "length"
        assert deltas[-1].prompt_logprobs == [None, -1.5, -0.5]
        assert prefill.in_flight == decode.in_flight == 0

    asyncio.run(main())


def test_failed_prefill_before_any_token_retries_on_a_new_pair_with_a_new_room():
    async def main():
        config = RouterConfig(workers=[], max_retries=1, prefill_policy="round_robin", decode_policy="round_robin")
        bad_prefill = make_worker("prefill", 1, lambda r: FakeCall([], grpc.StatusCode.UNAVAILABLE), config)
        good_prefill = make_worker("prefill", 3, prefill_stream, config)
        decodes = [make_worker("decode", 2, decode_stream, config), make_worker("decode", 4, decode_stream, config)]
        dispatcher = Dispatcher(FakeRegistry([bad_prefill, good_prefill, *decodes]), config)
        deltas = await collect(dispatcher, token_request())
        assert [t for d in deltas for t in d.token_ids] == [5, 6, 7]
        rooms = {r.disaggregated_params.bootstrap_room for w in (bad_prefill, good_prefill)
                 for r in w.stub.requests}
        assert len(rooms) == 2  # the retry drew a new room
        await asyncio.sleep(0.05)
        first_decode = next(w for w in decodes if w.stub.requests and w.stub.requests[0].request_id == "req-1")
        assert first_decode.stub.aborts == ["req-1"]  # the other leg of the failed pair was aborted
        assert bad_prefill.breaker.consecutive_failures == 1

    asyncio.run(main())


def test_failure_with_no_retries_left_is_503():
    async def main():
        config = RouterConfig(workers=[], max_retries=0)
        prefill = make_worker("prefill", 1, lambda r: FakeCall([], grpc.StatusCode.UNAVAILABLE), config)
        decode = make_worker("decode", 2, decode_stream, config)
        with pytest.raises(ApiError) as info:
            await collect(Dispatcher(FakeRegistry([prefill, decode]), config), token_request())
        assert info.value.status == 503

    asyncio.run(main())


def test_a_decode_that_cannot_reach_its_prefill_blames_the_prefill_and_retries_elsewhere():
    """The failure kind decides: bootstrap_unreachable from the decode is the prefill's fault (retried on another
    pair, counted against the prefill's breaker, not the healthy decode's)."""
    async def main():
        config = RouterConfig(workers=[], max_retries=1, prefill_policy="round_robin", decode_policy="round_robin")
        prefills = [make_worker("prefill", 1, prefill_stream, config), make_worker("prefill", 3, prefill_stream, config)]
        unreachable_once = iter([FakeCall([], grpc.StatusCode.UNAVAILABLE, kind="bootstrap_unreachable")])
        decode = make_worker("decode", 2, lambda r: next(unreachable_once, None) or decode_stream(r), config)
        dispatcher = Dispatcher(FakeRegistry([*prefills, decode]), config)
        deltas = await collect(dispatcher, token_request())
        assert [t for d in deltas for t in d.token_ids] == [5, 6, 7]
        first_prefill = next(w for w in prefills if w.stub.requests[0].request_id == "req-1")
        assert first_prefill.breaker.consecutive_failures == 1
        assert decode.breaker.consecutive_failures == 0
        assert len(decode.stub.requests) == 2  # the same decode, paired with the other prefill

    asyncio.run(main())


def test_a_transfer_timeout_is_504_naming_the_timeout_that_fired_and_blames_nobody():
    async def main():
        config = RouterConfig(workers=[], max_retries=0)
        prefill = make_worker("prefill", 1, prefill_stream, config)
        decode = make_worker("decode", 2, lambda r: FakeCall([], grpc.StatusCode.DEADLINE_EXCEEDED,
                                                             kind="transfer_timeout"), config)
        with pytest.raises(ApiError) as info:
            await collect(Dispatcher(FakeRegistry([prefill, decode]), config), token_request())
        assert info.value.status == 504 and "--transfer-timeout" in str(info.value)
        assert prefill.breaker.consecutive_failures == decode.breaker.consecutive_failures == 0

    asyncio.run(main())


def test_cache_aware_routes_to_the_dp_rank_holding_the_prefix_and_pins_each_leg():
    """A --dp-size 2 prefill is two caches to cache_aware: the rank whose KV events hold the prompt's pages gets the
    prefill leg (data_parallel_rank 1), the decode leg pins its own rank; round_robin legs stay unpinned; every
    rank's in-flight count returns to 0."""
    from smg_grpc_proto.generated import common_pb2

    async def main():
        config = RouterConfig(workers=[], prefill_policy="cache_aware", decode_policy="cache_aware")
        prefill, decode = make_worker("prefill", 1, prefill_stream, config), make_worker("decode", 2, decode_stream,
                                                                                       config)
        for worker in (prefill, decode):
            worker.kv_index.page_size = 1
            worker.set_dp_size(2)
        hashes = RouteRequest([1, 2, 3]).hashes(1)
        batch = common_pb2.KvEventBatch(sequence_number=1, dp_rank=1)
        batch.events.add().stored.blocks.add(block_hash=hashes[0], block_size=1)
        batch.events[0].stored.blocks.add(block_hash=hashes[1], block_size=1)
        prefill.kv_index_of(batch).apply(batch)
        assert prefill.dp_ranks[1].kv_index.blocks and not prefill.kv_index.blocks
        decode.dp_ranks[0].load = WorkerLoad(running=3)  # the decode's other rank is idle
        registry = FakeRegistry([prefill, decode])
        registry.listeners = []
        admission = Admission(registry, max_running=10, max_queued=1, queue_timeout_s=1)
        dispatcher = Dispatcher(registry, config, admission=admission)
        seen = []
        real_place = admission.place
        admission.place = lambda worker, tokens, rank=None: seen.append(rank) or real_place(worker, tokens, rank)
        await collect(dispatcher, token_request())
        assert seen == [decode.dp_ranks[1]]  # the decode leg's KV is reserved on its rank, and released after
        assert not decode.dp_ranks[1].kv.placements and not decode.kv.placements
        [p_req], [d_req] = prefill.stub.requests, decode.stub.requests
        assert (p_req.data_parallel_rank, d_req.data_parallel_rank) == (1, 1)
        assert p_req.disaggregated_params == d_req.disaggregated_params  # one room for the pair
        assert all(r.in_flight == 0 for w in (prefill, decode) for r in w.dp_ranks)
        dispatcher.policies[Role.PREFILL] = dispatcher.policies[Role.DECODE] = RoundRobin()
        await collect(dispatcher, token_request())
        assert not any(r.HasField("data_parallel_rank") for r in (prefill.stub.requests[-1], decode.stub.requests[-1]))
        prefill.set_dp_size(1)  # restarted at dp 1: ranks (and their caches) are gone
        assert prefill.routing_targets() == [prefill]

    asyncio.run(main())
