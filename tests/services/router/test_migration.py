"""Request migration with stand-in workers: a token leg that fails after tokens reached the client is continued
on another worker with the delivered tokens carried (prompt + output so far, max_new_tokens reduced, the
resumed-tokens metadata), the stream goes on with no gap or repeat, usage reads as one request's, and the
budget, the reasons and the reservations are kept."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import CollectorRegistry
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tandem.common.rpc.resume import RESUMED_OUTPUT_TOKENS_KEY
from tandem.common.telemetry.metrics import MIGRATION_REASONS, RouterMetrics
from tandem.services.router.admission import Admission
from tandem.services.router.config import RouterConfig
from tandem.services.router.dispatch import Dispatcher
from tandem.services.router.errors import ApiError
from tandem.services.router.legs import LegFailure
from tandem.services.router.messages import SamplingOptions, TokenRequest
from tandem.services.router.migration import HealthLost, migration_reason
from tests.services.router.test_dispatch_pd import FakeCall, FakeRegistry, FakeStub, make_worker, prefill_stream

PROMPT = [1, 2, 3]


class MetadataStub(FakeStub):
    """FakeStub that also keeps each Generate call's metadata."""

    def __init__(self, script):
        super().__init__(script)
        self.metadata: list[dict] = []

    def Generate(self, request, timeout=None, metadata=None):
        self.metadata.append(dict(metadata or ()))
        return super().Generate(request, timeout)


class HangingCall(FakeCall):
    """Yields its responses, then waits (a worker that stopped answering) until cancelled."""

    async def _iterate(self):
        for response in self.responses:
            await asyncio.sleep(0)
            yield response
        await asyncio.Event().wait()


class Registry(FakeRegistry):
    listeners: list = []

    def kv_holders(self):
        return [w for w in self.workers.values() if w.role != "prefill"]


def worker(role: str, port: int, script, config: RouterConfig):
    w = make_worker(role, port, script, config)
    w.stub = MetadataStub(script)
    return w


def chunk(ids, index=0, completion=0, cached=0, prompt=len(PROMPT), logprobs=None):
    c = pb.GenerateStreamChunk(token_ids=ids, index=index, prompt_tokens=prompt, completion_tokens=completion,
                               cached_tokens=cached)
    if logprobs is not None:
        c.output_logprobs.token_logprobs.extend(logprobs)
    return pb.GenerateResponse(chunk=c)


def complete(ids, index=0, reason="length", prompt=len(PROMPT), cached=0):
    return pb.GenerateResponse(complete=pb.GenerateComplete(output_ids=ids, index=index, finish_reason=reason,
                                                            prompt_tokens=prompt, completion_tokens=len(ids),
                                                            cached_tokens=cached))


def request(n=1, max_new_tokens=6, **kw) -> TokenRequest:
    return TokenRequest("req-1", list(PROMPT), SamplingOptions(temperature=1.0, seed=11, n=n),
                        max_new_tokens=max_new_tokens, **kw)


def dispatcher(workers, **flags) -> tuple[Dispatcher, RouterMetrics]:
    config = RouterConfig(workers=[], policy="round_robin", **flags)
    metrics = RouterMetrics(CollectorRegistry())
    registry = Registry(workers)
    return Dispatcher(registry, config, metrics, Admission(registry, 8, 8, 1.0)), metrics


def migrations(metrics: RouterMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value("tandem_router_migrations_total", {"reason": reason})


async def collect(d: Dispatcher, req: TokenRequest):
    return [delta async for delta in d.generate(req)]


def test_a_killed_worker_s_request_continues_on_another_with_the_delivered_tokens_carried(monkeypatch):
    events = []
    monkeypatch.setattr("tandem.services.router.dispatch.add_event", lambda span, name, attrs: events.append(
        (name, attrs)))

    async def main():
        config = RouterConfig(workers=[])
        dying = worker("unified", 1, lambda r: FakeCall([chunk([5, 6], completion=2, cached=2)],
                                                       grpc.StatusCode.UNAVAILABLE), config)
        taking_over = worker("unified", 2, lambda r: FakeCall([chunk([7], completion=1, prompt=5, cached=4),
                                                               complete([7, 8], prompt=5, cached=4)]), config)
        d, metrics = dispatcher([dying, taking_over])
        deltas = await collect(d, request())
        assert [t for x in deltas for t in x.token_ids] == [5, 6, 7, 8]  # no gap, no repeat
        [resumed] = taking_over.stub.requests
        assert list(resumed.tokenized.input_ids) == PROMPT + [5, 6]
        assert resumed.sampling_params.max_new_tokens == 4
        assert resumed.sampling_params.custom_params["seed"] == 11  # the seed stays: draws depend on position
        assert taking_over.stub.metadata == [{RESUMED_OUTPUT_TOKENS_KEY: "2"}]
        assert dying.stub.metadata == [{}]
        last = deltas[-1]
        assert last.finished and last.finish_reason == "length"
        # Usage as one request's: the original prompt, every output token, the first attempt's cache hits.
        assert (last.prompt_tokens, last.completion_tokens, last.cached_tokens) == (3, 4, 2)
        assert migrations(metrics, "unavailable") == 1 and metrics.retries._value.get() == 0
        [(name, attrs)] = events  # the span event on the request's trace
        assert name == "migration" and attrs["tandem.worker"] == "10.0.0.1:1"
        assert (attrs["tandem.attempt"], attrs["tandem.carried_tokens"], attrs["tandem.reason"]) == (1, 2, "unavailable")
        for w in (dying, taking_over):  # reservations and in-flight counts all released
            assert w.in_flight == 0 and not w.kv.placements
        assert d.admission.unplaced == 0

    asyncio.run(main())


def test_the_continuation_reserves_what_the_sequence_may_still_hold_and_the_failed_worker_s_goes():
    async def main():
        config = RouterConfig(workers=[])
        seen = {}

        class Watched(FakeCall):
            async def _iterate(self):
                await asyncio.sleep(0)  # the attempt has placed its reservation by now
                seen.update({w.endpoint.port: w.kv.reserved for w in (dying, taking_over)})
                yield complete([7, 8])

        dying = worker("unified", 1, lambda r: FakeCall([chunk([5, 6])], grpc.StatusCode.UNAVAILABLE), config)
        taking_over = worker("unified", 2, lambda r: Watched([]), config)
        d, _ = dispatcher([dying, taking_over])
        await collect(d, request(max_new_tokens=6))
        # The prompt and the carried tokens plus what may still come: 3 + 2 + 4; the failed worker's is gone.
        assert seen == {1: 0, 2: 9}
        assert dying.kv.reserved == taking_over.kv.reserved == 0

    asyncio.run(main())


def test_max_migrations_0_ends_the_stream_with_the_failure_as_before():
    async def main():
        config = RouterConfig(workers=[])
        dying = worker("unified", 1, lambda r: FakeCall([chunk([5])], grpc.StatusCode.UNAVAILABLE), config)
        other = worker("unified", 2, lambda r: FakeCall([complete([6])]), config)
        d, metrics = dispatcher([dying, other], max_migrations=0)
        got = []
        with pytest.raises(ApiError) as info:
            async for delta in d.generate(request()):
                got.append(delta)
        assert [t for x in got for t in x.token_ids] == [5]
        assert info.value.status == 503 and "worker 10.0.0.1:1 failed" in info.value.message
        assert not other.stub.requests and migrations(metrics, "unavailable") == 0

    asyncio.run(main())


def test_a_spent_budget_is_a_clear_error_naming_the_last_failure():
    async def main():
        config = RouterConfig(workers=[])
        workers = [worker("unified", p, lambda r, p=p: FakeCall([chunk([10 + p])], grpc.StatusCode.INTERNAL),
                          config) for p in (1, 2, 3)]
        d, metrics = dispatcher(workers, max_migrations=2)
        with pytest.raises(ApiError) as info:
            await collect(d, request())
        third = next(w for w in workers if w.stub.requests and len(w.stub.requests[0].tokenized.input_ids) == 5)
        message = info.value.message
        assert info.value.status == 503 and "failed after 2 migrations" in message
        assert f"last failure: worker {third.endpoint.address}: INTERNAL" in message
        assert third.stub.metadata == [{RESUMED_OUTPUT_TOKENS_KEY: "2"}]  # each migration carried all before it
        assert migrations(metrics, "error") == 2

    asyncio.run(main())


def test_with_no_other_worker_the_request_fails_at_once():
    async def main():
        config = RouterConfig(workers=[])
        alone = worker("unified", 1, lambda r: FakeCall([chunk([5])], grpc.StatusCode.UNAVAILABLE), config)
        d, metrics = dispatcher([alone])
        with pytest.raises(ApiError) as info:
            await collect(d, request())
        assert "no other healthy worker to migrate the request to" in info.value.message
        assert len(alone.stub.requests) == 1 and migrations(metrics, "unavailable") == 1

    asyncio.run(main())


def test_n_2_continues_each_unfinished_sequence_as_its_own_request_with_its_sibling_seed():
    async def main():
        config = RouterConfig(workers=[])
        dying = worker("unified", 1, lambda r: FakeCall(
            [chunk([5], index=0), chunk([9], index=1), complete([9, 3], index=1, reason="stop")],
            grpc.StatusCode.UNAVAILABLE), config)
        taking_over = worker("unified", 2, lambda r: FakeCall([complete([6, 7])]), config)
        d, _ = dispatcher([dying, taking_over])
        deltas = await collect(d, request(n=2, max_new_tokens=3))
        tokens = {i: [t for x in deltas if x.index == i for t in x.token_ids] for i in (0, 1)}
        assert tokens == {0: [5, 6, 7], 1: [9, 3]}  # sequence 1 had finished: it stays as it was
        [resumed] = taking_over.stub.requests
        assert resumed.sampling_params.n == 1 and resumed.sampling_params.custom_params["seed"] == 11
        assert list(resumed.tokenized.input_ids) == PROMPT + [5]
        finals = {x.index: x for x in deltas if x.finished}
        assert finals[0].completion_tokens == 3 and finals[1].finish_reason == "stop"

    asyncio.run(main())


def test_n_2_sequence_1_continues_with_seed_plus_1():
    async def main():
        config = RouterConfig(workers=[])
        dying = worker("unified", 1, lambda r: FakeCall([chunk([5], index=0), complete([5, 6], index=0),
                                                         chunk([9], index=1)], grpc.StatusCode.UNAVAILABLE), config)
        taking_over = worker("unified", 2, lambda r: FakeCall([complete([4])]), config)
        d, _ = dispatcher([dying, taking_over])
        deltas = await collect(d, request(n=2, max_new_tokens=2))
        [resumed] = taking_over.stub.requests
        assert resumed.sampling_params.custom_params["seed"] == 12
        assert [t for x in deltas if x.index == 1 for t in x.token_ids] == [9, 4]

    asyncio.run(main())


def test_logprobs_stay_and_continue_and_prompt_logprobs_are_the_original_prompt_s():
    async def main():
        config = RouterConfig(workers=[])
        dying = worker("unified", 1, lambda r: FakeCall([chunk([5, 6], logprobs=[-0.5, -0.6])],
                                                       grpc.StatusCode.UNAVAILABLE), config)

        def take_over(r):
            done = pb.GenerateComplete(output_ids=[7], finish_reason="length", prompt_tokens=5, completion_tokens=1)
            done.output_logprobs.token_logprobs.append(-0.7)
            for value in (None, -1.0, -2.0, -3.0, -4.0):  # the continuation's prompt: the original's and 5, 6
                entry = done.input_logprobs.token_logprobs.add()
                if value is not None:
                    entry.value = value
            return FakeCall([pb.GenerateResponse(complete=done)])

        taking_over = worker("unified", 2, take_over, config)
        d, _ = dispatcher([dying, taking_over])
        deltas = await collect(d, request(max_new_tokens=3, return_logprob=True, prompt_logprobs=True))
        assert [lp for x in deltas for lp in x.logprobs] == pytest.approx([-0.5, -0.6, -0.7])
        assert deltas[-1].prompt_logprobs == [None, -1.0, -2.0]
        assert taking_over.stub.requests[0].logprob_start_len == 0  # asked again: the first never came

    asyncio.run(main())


def test_the_last_token_delivered_without_its_ending_ends_at_its_length():
    async def main():
        config = RouterConfig(workers=[])
        dying = worker("unified", 1, lambda r: FakeCall([chunk([5, 6])], grpc.StatusCode.UNAVAILABLE), config)
        other = worker("unified", 2, lambda r: FakeCall([complete([1])]), config)
        d, _ = dispatcher([dying, other])
        deltas = await collect(d, request(max_new_tokens=2))
        assert deltas[-1].finished and deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == 2
        assert not other.stub.requests

    asyncio.run(main())


def test_a_worker_aborting_the_request_migrates_it_with_reason_aborted():
    async def main():
        config = RouterConfig(workers=[])
        aborting = worker("unified", 1, lambda r: FakeCall([chunk([5]), complete([5], reason="abort")]), config)
        other = worker("unified", 2, lambda r: FakeCall([complete([6])]), config)
        d, metrics = dispatcher([aborting, other])
        deltas = await collect(d, request(max_new_tokens=2))
        assert [t for x in deltas for t in x.token_ids] == [5, 6]
        assert migrations(metrics, "aborted") == 1

    asyncio.run(main())


def test_a_worker_losing_health_mid_stream_migrates_its_requests():
    async def main():
        config = RouterConfig(workers=[])
        stuck = worker("unified", 1, lambda r: HangingCall([chunk([5])]), config)
        other = worker("unified", 2, lambda r: FakeCall([complete([6])]), config)
        d, metrics = dispatcher([stuck, other])
        task = asyncio.create_task(collect(d, request(max_new_tokens=2)))
        while not stuck.on_unhealthy:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)
        for told in list(stuck.on_unhealthy):  # what WorkerRegistry.check_health does on a failed probe
            told("UNAVAILABLE: probe failed")
        deltas = await task
        assert [t for x in deltas for t in x.token_ids] == [5, 6]
        assert migrations(metrics, "health") == 1 and not stuck.on_unhealthy
        await asyncio.sleep(0.01)
        assert stuck.stub.aborts == ["req-1"] and stuck.stub.calls[0].cancelled

    asyncio.run(main())


def test_pd_decode_failure_migrates_to_another_pair_with_both_legs_marked():
    async def main():
        config = RouterConfig(workers=[])
        prefill = worker("prefill", 1, prefill_stream, config)
        dying = worker("decode", 2, lambda r: FakeCall([chunk([5])], grpc.StatusCode.UNAVAILABLE), config)
        other = worker("decode", 4, lambda r: FakeCall([complete([6, 7])]), config)
        d, _ = dispatcher([prefill, dying, other], prefill_policy="round_robin", decode_policy="round_robin")
        deltas = await collect(d, request(max_new_tokens=3))
        assert [t for x in deltas for t in x.token_ids] == [5, 6, 7]
        assert prefill.stub.metadata == [{}, {RESUMED_OUTPUT_TOKENS_KEY: "1"}]
        assert other.stub.metadata == [{RESUMED_OUTPUT_TOKENS_KEY: "1"}]
        assert prefill.stub.requests[1].disaggregated_params.bootstrap_room \
            == other.stub.requests[0].disaggregated_params.bootstrap_room

    asyncio.run(main())


def test_pd_prefill_failing_after_the_decode_sent_tokens_does_not_touch_the_decode():
    async def main():
        config = RouterConfig(workers=[])
        gate = asyncio.Event()

        class SlowDecode(FakeCall):
            async def _iterate(self):
                yield chunk([5])
                await gate.wait()
                yield complete([5, 6, 7])

        class DyingPrefill(FakeCall):
            async def _iterate(self):
                await asyncio.sleep(0.05)  # after the decode's first token
                gate.set()
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           details="killed")
                yield

        prefill = worker("prefill", 1, lambda r: DyingPrefill([]), config)
        decode = worker("decode", 2, lambda r: SlowDecode([]), config)
        d, metrics = dispatcher([prefill, decode])
        deltas = await collect(d, request(max_new_tokens=3))
        assert [t for x in deltas for t in x.token_ids] == [5, 6, 7]
        assert sum(migrations(metrics, r) for r in MIGRATION_REASONS) == 0 and len(decode.stub.requests) == 1

    asyncio.run(main())


def test_reasons_are_a_closed_set():
    asyncio.run(_reasons())


async def _reasons():
    config = RouterConfig(workers=[])
    w = make_worker("decode", 2, None, config)
    cases = {"unavailable": LegFailure(w, "x", grpc.StatusCode.UNAVAILABLE),
             "aborted": LegFailure(w, "x", grpc.StatusCode.ABORTED),
             "health": HealthLost(w, "x"),
             "error": LegFailure(w, "x", grpc.StatusCode.INTERNAL)}
    from tandem.common.transfer.failures import FailureKind
    cases["transfer"] = LegFailure(w, "x", grpc.StatusCode.UNAVAILABLE, FailureKind.PEER_LOST)
    for reason, failure in cases.items():
        assert migration_reason(failure) == reason
    assert migration_reason(LegFailure(w, "x", grpc.StatusCode.UNAVAILABLE, FailureKind.SHUTDOWN)) == "unavailable"
    assert set(cases) == set(MIGRATION_REASONS)


def test_a_failed_health_check_tells_the_legs_running_on_the_worker_once():
    from tandem.services.router.workers import WorkerRegistry

    class DownStub:
        async def HealthCheck(self, request, timeout=None):
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="connection refused")

    async def main():
        config = RouterConfig(workers=[])
        registry = WorkerRegistry(config)
        w = make_worker("unified", 1, None, config)
        w.stub = DownStub()
        told = []
        w.on_unhealthy.add(told.append)
        await registry.check_health(w)
        await registry.check_health(w)  # still down: no news
        assert told == ["UNAVAILABLE: connection refused"] and not w.healthy

    asyncio.run(main())
