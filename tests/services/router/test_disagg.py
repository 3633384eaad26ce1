"""Conditional disaggregation: the pair-or-local decision for each reason, and the dispatcher acting on it (legs,
metric, no prefill under `always`) with stand-in workers."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from tandem.common.memory.page_hash import page_hashes
from tandem.common.telemetry.metrics import RouterMetrics
from tandem.services.router.config import RouterConfig
from tandem.services.router.kv_index import DEVICE, DISK, HOST
from tandem.services.router.disagg import (DisaggSignals, DisaggThresholds, best_cached, cached_tokens, decide)
from tandem.services.router.dispatch import Dispatcher
from tandem.services.router.errors import NoWorkerError
from tandem.services.router.policies import RouteRequest
from tests.services.router.test_dispatch_pd import (FakeRegistry, collect, decode_stream, make_worker,
                                                    prefill_stream, token_request)

LIMITS = DisaggThresholds(max_local_tokens=64, saturated_queue=4, min_free_kv=0.1, max_decode_waiting=2)


def signals(prompt=1000, cached=0, prefill=True, waiting=0, free=10_000, total=10_000,
            decode_waiting=0) -> DisaggSignals:
    return DisaggSignals(prompt_tokens=prompt, uncached_tokens=prompt - cached, prefill_available=prefill,
                         prefill_waiting=waiting, decode_free_tokens=free, decode_total_tokens=total,
                         decode_waiting=decode_waiting)


@pytest.mark.parametrize("policy, sig, expected", [
    ("always", signals(prefill=False), ("local", "prefill_unavailable")),
    ("auto", signals(prefill=False, free=100), ("local", "prefill_unavailable")),
    ("always", signals(prompt=8), ("pair", "policy_always")),
    ("never", signals(prompt=5000), ("local", "policy_never")),
    ("auto", signals(prompt=8, free=1000), ("pair", "decode_kv_low")),
    ("auto", signals(prompt=64), ("local", "short_prompt")),
    ("auto", signals(prompt=1000, cached=960), ("local", "cached_prefix")),
    ("auto", signals(prompt=1000, cached=900), ("pair", "long_prompt")),
    ("auto", signals(prompt=1000, waiting=5), ("local", "prefill_saturated")),
    ("auto", signals(prompt=1000, waiting=4), ("pair", "long_prompt")),
    ("auto", signals(prompt=8, free=None, total=0), ("local", "short_prompt")),  # the decode has not reported yet
    ("auto", signals(prompt=8, decode_waiting=1), ("local", "short_prompt")),
    ("auto", signals(prompt=8, decode_waiting=2), ("pair", "decode_busy")),  # local prefills already queue there
    ("auto", signals(prompt=1000, cached=960, decode_waiting=3), ("pair", "decode_busy")),
    ("auto", signals(prompt=1000, waiting=5, decode_waiting=2), ("pair", "decode_busy")),  # both busy: the pair
    ("auto", signals(prefill=False, decode_waiting=9), ("local", "prefill_unavailable")),  # else it would fail
    ("always", signals(prompt=8, decode_waiting=9), ("pair", "policy_always")),
    ("never", signals(prompt=8, decode_waiting=9), ("local", "policy_never")),
])
def test_decide_gives_each_reason(policy, sig, expected):
    decision = decide(policy, LIMITS, sig)
    assert (decision.decision, decision.reason) == expected
    assert decision.local == (expected[0] == "local")


def test_kv_headroom_counts_the_uncached_prompt_only():
    """1000 free of 10000, 960 cached: the local prefill needs 40 pages' worth, leaving 960 < 10 % → pair; with
    more free tokens the same prompt goes local as a cached prefix."""
    assert decide("auto", LIMITS, signals(prompt=1000, cached=960, free=1000)).reason == "decode_kv_low"
    assert decide("auto", LIMITS, signals(prompt=1000, cached=960, free=1100)).reason == "cached_prefix"


def test_a_long_prompt_goes_local_only_for_a_saturated_or_missing_prefill():
    """However much room the decode has, a long prompt uses a healthy, unsaturated prefill worker."""
    idle_decode = dict(free=10**7, total=10**7, decode_waiting=0)
    for waiting in range(LIMITS.saturated_queue + 1):
        assert decide("auto", LIMITS, signals(prompt=5000, waiting=waiting, **idle_decode)).reason == "long_prompt"
    assert decide("auto", LIMITS, signals(prompt=5000, waiting=LIMITS.saturated_queue + 1,
                                          **idle_decode)).reason == "prefill_saturated"
    assert decide("auto", LIMITS, signals(prompt=5000, prefill=False, **idle_decode)).reason == "prefill_unavailable"


def _with_cache(worker, prompt: list[int], pages: int, page_size: int = 4, tier: int = DEVICE):
    worker.kv_index.page_size = page_size
    worker.kv_index.add(page_hashes(prompt, page_size)[:pages], tier)
    return worker


def test_best_cached_picks_the_decode_holding_the_longest_prefix():
    async def main():
        config = RouterConfig(workers=[])
        prompt = list(range(40))
        a, b, c = (make_worker("decode", port, decode_stream, config) for port in (2, 4, 6))
        _with_cache(a, prompt, 3)
        _with_cache(b, prompt, 7)
        route = RouteRequest(prompt)
        assert cached_tokens(c, route) == 0  # no page size known yet: nothing counted
        assert best_cached([a, b, c], route) == (b, 28)

    asyncio.run(main())


def test_cached_tokens_weigh_a_prefix_by_its_tier():
    """The decode's cached prefix counts fully on its device, less in host memory, least on disk: the local
    prefill estimate (`uncached_tokens`) grows with the work of reading the prefix back."""
    async def main():
        config = RouterConfig(workers=[])
        prompt = list(range(40))
        device, host, disk = (make_worker("decode", port, decode_stream, config) for port in (2, 4, 6))
        _with_cache(device, prompt, 10)
        _with_cache(host, prompt, 10, tier=HOST)
        _with_cache(disk, prompt, 10, tier=DISK)
        route = RouteRequest(prompt)
        assert [cached_tokens(w, route) for w in (device, host, disk)] == [40, 32, 12]
        assert best_cached([disk, host], route) == (host, 32)

    asyncio.run(main())


def _dispatcher(policy: str, prefill_healthy: bool = True, local_prefill: bool = True, **kw):
    config = RouterConfig(workers=[], disagg_policy=policy, local_prefill_max_tokens=4, max_retries=0, **kw)
    prefill = make_worker("prefill", 1, prefill_stream, config)
    prefill.healthy = prefill_healthy
    decode = make_worker("decode", 2, decode_stream, config)
    decode.local_prefill = local_prefill
    metrics = RouterMetrics(CollectorRegistry())
    return Dispatcher(FakeRegistry([prefill, decode]), config, metrics), prefill, decode, metrics


def _decisions(metrics: RouterMetrics, decision: str, reason: str) -> float:
    value = metrics.registry.get_sample_value("tandem_router_disagg_decisions_total",
                                              {"decision": decision, "reason": reason})
    return value or 0.0


def test_auto_sends_a_short_prompt_to_the_decode_alone_and_a_long_one_to_the_pair():
    async def main():
        dispatcher, prefill, decode, metrics = _dispatcher("auto")
        short = await collect(dispatcher, token_request())  # 3 prompt tokens <= 4
        assert [t for d in short for t in d.token_ids] == [5, 6, 7]
        assert prefill.stub.requests == []
        assert not decode.stub.requests[0].HasField("disaggregated_params")  # a plain request: prefilled there
        long_request = token_request()
        long_request.input_ids = list(range(1, 11))
        await collect(dispatcher, long_request)
        assert len(prefill.stub.requests) == 1 and decode.stub.requests[1].HasField("disaggregated_params")
        assert _decisions(metrics, "local", "short_prompt") == 1
        assert _decisions(metrics, "pair", "long_prompt") == 1
        assert prefill.in_flight == decode.in_flight == 0

    asyncio.run(main())


def test_auto_sends_a_short_prompt_to_the_pair_while_local_prefills_queue_on_the_decode():
    async def main():
        dispatcher, prefill, decode, metrics = _dispatcher("auto", local_prefill_max_waiting=2)
        decode.load.waiting = 2  # as its last load report said
        await collect(dispatcher, token_request())  # 3 prompt tokens: short, but the decode is busy
        assert len(prefill.stub.requests) == 1 and decode.stub.requests[0].HasField("disaggregated_params")
        assert _decisions(metrics, "pair", "decode_busy") == 1
        decode.load.waiting = 1
        await collect(dispatcher, token_request())
        assert len(prefill.stub.requests) == 1 and not decode.stub.requests[1].HasField("disaggregated_params")
        assert _decisions(metrics, "local", "short_prompt") == 1

    asyncio.run(main())


def test_always_prefills_locally_when_no_prefill_worker_is_available():
    async def main():
        dispatcher, prefill, decode, metrics = _dispatcher("always", prefill_healthy=False)
        deltas = await collect(dispatcher, token_request())
        assert [t for d in deltas for t in d.token_ids] == [5, 6, 7]
        assert prefill.stub.requests == [] and len(decode.stub.requests) == 1
        assert _decisions(metrics, "local", "prefill_unavailable") == 1

    asyncio.run(main())


def test_a_decode_that_cannot_prefill_never_gets_a_plain_request():
    """A decode whose server info lacks local_prefill (smg's, an older Tandem's): the pair under every policy, and
    no worker at all once the prefill is gone."""
    async def main():
        dispatcher, prefill, decode, _ = _dispatcher("never", local_prefill=False)
        legs = dispatcher.pick_legs(RouteRequest([1, 2, 3]), set())
        assert [leg.worker for leg in legs] == [prefill, decode]
        prefill.healthy = False
        with pytest.raises(NoWorkerError):
            dispatcher.pick_legs(RouteRequest([1, 2, 3]), set())

    asyncio.run(main())


def test_never_keeps_every_request_on_the_decode():
    async def main():
        dispatcher, prefill, decode, metrics = _dispatcher("never")
        legs, decision = dispatcher.pick_route(RouteRequest(list(range(100))), set())
        assert [leg.worker for leg in legs] == [decode] and decision.reason == "policy_never"
        assert _decisions(metrics, "local", "policy_never") == 1

    asyncio.run(main())


def test_a_prefill_that_failed_this_request_is_not_retried_while_the_decode_can_prefill():
    async def main():
        dispatcher, prefill, decode, metrics = _dispatcher("always")
        legs, decision = dispatcher.pick_route(RouteRequest([1, 2, 3]), {prefill.endpoint})
        assert [leg.worker for leg in legs] == [decode] and decision.reason == "prefill_unavailable"

    asyncio.run(main())


def test_the_registry_is_ready_with_a_decode_that_prefills_locally_and_no_prefill():
    """Readiness and admission's KV holders: a decode alone serves once it says local_prefill."""
    from tandem.services.router.workers import WorkerRegistry

    async def main():
        config = RouterConfig(workers=[])
        registry = WorkerRegistry(config)
        prefill, decode = make_worker("prefill", 1, prefill_stream, config), make_worker("decode", 2, decode_stream,
                                                                                       config)
        registry.workers = {w.endpoint: w for w in (prefill, decode)}
        assert registry.ready() and registry.kv_holders() == [decode]
        prefill.healthy = False
        assert not registry.ready() and registry.kv_holders() == []
        decode.local_prefill = True
        assert registry.ready() and registry.kv_holders() == [decode]

    asyncio.run(main())
