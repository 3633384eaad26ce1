"""Admission by KV capacity: a request runs when a decode (or unified) worker has room for prompt + max_tokens,
else it waits in a FIFO queue; a full queue or a long wait is 429 with Retry-After; reservations follow dispatch."""

from __future__ import annotations

import asyncio
import contextvars
import random
import statistics
import time

import pytest

from tandem.services.router.admission import RATIO_RISE, RATIO_STEP, Admission, NewTokenRatio, kv_tokens
from tandem.services.router.errors import ApiError
from tandem.services.router.messages import SamplingOptions, TokenRequest
from tandem.services.router.workers import KvCapacity, Placement, WorkerLoad


class FakeWorker:
    def __init__(self, total: int, role: str = "decode"):
        self.kv = KvCapacity(total=total, reported_at=time.monotonic())
        self.role, self.load = role, WorkerLoad()


class FakeRegistry:
    def __init__(self, *workers: FakeWorker):
        self.workers = list(workers)
        self.listeners = []

    def kv_holders(self):
        return self.workers


def request(prompt: int, max_new: int, n: int = 1) -> TokenRequest:
    return TokenRequest("r", list(range(prompt)), SamplingOptions(n=n), max_new_tokens=max_new)


def test_reservation_is_prompt_plus_max_tokens_per_sequence():
    assert kv_tokens(request(10, 30)) == 40
    assert kv_tokens(request(10, 30, n=3)) == 120


def test_capacity_counts_reservations_and_what_the_report_does_not_show_yet():
    kv = KvCapacity(total=1000, used=300, reported_at=time.monotonic())
    assert kv.free() == 700  # another router's (or the prefix of a finished) requests: the report says so
    kv.placements.add(Placement(200))  # placed after the poll was sent: not in `used` yet
    assert kv.free() == 500
    kv.reported_at = time.monotonic()  # the next report includes it (used 350: it is part way)
    kv.used = 350
    assert kv.free() == 650
    kv.used = 100  # our reservation is the worst case of what our request can come to hold
    assert kv.free() == 800
    assert KvCapacity().free() is None and KvCapacity().fits(10**9)  # not reported yet: not refused
    assert KvCapacity(total=100).fits(500)  # larger than the pool: runs alone on an empty worker


def test_a_request_waits_for_capacity_and_runs_when_an_earlier_one_releases_it():
    async def scenario():
        worker = FakeWorker(100)
        admission = Admission(FakeRegistry(worker), max_running=10, max_queued=4, queue_timeout_s=5)
        order = []

        async def run(name: str, hold: asyncio.Event):
            async with admission.admit(request(20, 40)):
                placement = admission.place(worker, 60)
                order.append(name)
                await hold.wait()
                admission.release(worker, placement)

        first_done, second_done = asyncio.Event(), asyncio.Event()
        first = asyncio.create_task(run("first", first_done))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(run("second", second_done))
        await asyncio.sleep(0.05)
        assert order == ["first"] and admission.waiting == 1 and worker.kv.reserved == 60
        first_done.set()
        await first
        await asyncio.sleep(0.01)
        assert order == ["first", "second"] and admission.waiting == 0
        second_done.set()
        await second
        assert admission.running == 0 and admission.unplaced == 0 and worker.kv.reserved == 0

    asyncio.run(scenario())


def test_full_queue_and_queue_timeout_are_429_with_retry_after():
    async def scenario():
        worker = FakeWorker(100)
        admission = Admission(FakeRegistry(worker), max_running=10, max_queued=1, queue_timeout_s=0.2)
        rejected = []
        admission.on_reject = rejected.append
        worker.kv.placements.add(Placement(100))  # the pool is spoken for
        waiting = asyncio.create_task(_enter(admission, request(10, 10)))
        await asyncio.sleep(0.01)
        with pytest.raises(ApiError) as full:
            await _enter(admission, request(10, 10))
        assert full.value.status == 429 and full.value.code == "queue_full"
        assert int(full.value.headers["Retry-After"]) >= 1
        with pytest.raises(ApiError) as timeout:
            await waiting
        assert timeout.value.status == 429 and timeout.value.code == "queue_timeout"
        assert "--queue-timeout-s" in timeout.value.message and timeout.value.headers["Retry-After"]
        assert rejected == ["queue_full", "queue_timeout"]
        assert admission.running == 0 and admission.waiting == 0 and admission.unplaced == 0

    asyncio.run(scenario())


def test_admitted_but_unplaced_tokens_count_against_every_worker():
    async def scenario():
        worker = FakeWorker(100)
        admission = Admission(FakeRegistry(worker), max_running=10, max_queued=4, queue_timeout_s=0.1)
        async with admission.admit(request(30, 30)) as ticket:  # 60 admitted, not placed yet
            assert ticket.unplaced == 60 and not admission.fits(60)
            with pytest.raises(ApiError):
                await _elsewhere(_enter(admission, request(30, 30)))
            admission.place(worker, 60)
            assert ticket.unplaced == 0 and admission.unplaced == 0 and worker.kv.reserved == 60
        assert admission.running == 0

    asyncio.run(scenario())


def test_the_running_limit_still_applies():
    async def scenario():
        admission = Admission(FakeRegistry(FakeWorker(10**6)), max_running=1, max_queued=0, queue_timeout_s=1)
        async with admission.admit(request(1, 1)):
            with pytest.raises(ApiError) as full:
                await _elsewhere(_enter(admission, request(1, 1)))
            assert full.value.code == "queue_full"

    asyncio.run(scenario())


def test_a_client_that_leaves_while_queued_gives_back_its_place():
    async def scenario():
        worker = FakeWorker(100)
        admission = Admission(FakeRegistry(worker), max_running=10, max_queued=4, queue_timeout_s=5)
        worker.kv.placements.add(placement := Placement(100))
        task = asyncio.create_task(_enter(admission, request(10, 10)))
        await asyncio.sleep(0.01)
        assert admission.waiting == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        admission.release(worker, placement)
        assert admission.waiting == 0 and admission.running == 0 and admission.unplaced == 0

    asyncio.run(scenario())


def test_a_request_closed_from_another_context_still_gives_back_its_slot():
    """A stream abandoned mid-way (a client's gRPC deadline) is finalized by the event loop outside the request's
    task: its ticket's context variable cannot be reset there, and the slot and reservation must be released
    anyway (they stayed held, a request the router counted as running forever)."""
    async def scenario():
        admission = Admission(FakeRegistry(FakeWorker(1000)), max_running=10, max_queued=4, queue_timeout_s=1)
        held = admission.admit(request(10, 10))
        await held.__aenter__()
        assert admission.running == 1 and admission.unplaced == 20
        await _elsewhere(held.__aexit__(None, None, None))
        assert admission.running == 0 and admission.unplaced == 0

    asyncio.run(scenario())


def _elsewhere(coro):
    """Another client's request: a task of its own, outside this request's context (as aiohttp runs each)."""
    return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())


async def _enter(admission: Admission, req: TokenRequest) -> None:
    async with admission.admit(req):
        pass


def test_the_prompts_of_one_batched_request_are_admitted_together_and_placed_from_every_ticket():
    async def scenario():
        worker = FakeWorker(100)
        admission = Admission(FakeRegistry(worker), max_running=10, max_queued=4, queue_timeout_s=0.1)
        async with admission.admit(request(20, 40)) as first:  # fits: 60 of 100
            async with admission.admit(request(20, 40)) as second:  # would not fit alone (120 > 100): not asked
                assert admission.running == 2 and admission.unplaced == 120
                placements = [admission.place(worker, 60), admission.place(worker, 60)]  # both from this context
                assert first.unplaced == second.unplaced == admission.unplaced == 0
                for placement in placements:
                    admission.release(worker, placement)
        assert admission.running == 0 and admission.unplaced == 0 and worker.kv.reserved == 0

    asyncio.run(scenario())


def test_dispatch_reserves_on_the_decode_leg_and_releases_when_the_request_ends():
    from tandem.services.router.config import RouterConfig
    from tandem.services.router.dispatch import Dispatcher
    from tests.services.router.test_dispatch_pd import decode_stream, make_worker, prefill_stream

    class Registry:
        def __init__(self, workers):
            self.workers = {w.endpoint: w for w in workers}
            self.listeners = []

        def by_role(self, role, available_only=True):
            return [w for w in self.workers.values() if w.role == role]

        def kv_holders(self):
            return self.by_role("decode")

    async def scenario():
        config = RouterConfig(workers=[], max_retries=0, decode_policy="round_robin")
        prefill = make_worker("prefill", 1, prefill_stream, config)
        # Two decodes: the first has no room for this request's 3 + 3 tokens, so dispatch picks the second.
        full, roomy = make_worker("decode", 2, decode_stream, config), make_worker("decode", 3, decode_stream, config)
        for worker, used in ((full, 98), (roomy, 0)):
            worker.kv = KvCapacity(total=100, used=used, reported_at=time.monotonic())
        registry = Registry([prefill, full, roomy])
        admission = Admission(registry, max_running=4, max_queued=4, queue_timeout_s=1)
        dispatcher = Dispatcher(registry, config, admission=admission)
        req = TokenRequest("r", [1, 2, 3], SamplingOptions(temperature=0.0), max_new_tokens=3)
        seen = []
        async with admission.admit(req):
            async for _ in dispatcher.generate(req):
                seen.append(roomy.kv.reserved)
        assert seen and set(seen) == {6} and not full.stub.requests and len(roomy.stub.requests) == 1
        assert roomy.kv.reserved == 0 and admission.unplaced == 0 and admission.running == 0

    asyncio.run(scenario())


def test_the_new_token_ratio_falls_a_step_per_early_finish_and_rises_four_per_long_one():
    ratio = NewTokenRatio(floor=0.1)
    assert ratio.value == 1.0  # nothing learned: the whole of max_tokens
    ratio.observe(1.0)
    assert ratio.value == 1.0  # a request that used all of it: the estimate was right
    assert ratio.reserve(request(10, 30, n=2)) == kv_tokens(request(10, 30, n=2)) == 80
    for _ in range(5):
        ratio.observe(0.05)
    assert ratio.value == pytest.approx(1.0 - 5 * RATIO_STEP)
    for _ in range(100):
        ratio.observe(0.0)
    assert ratio.value == 0.1  # the floor
    assert ratio.reserve(request(10, 30, n=2)) == 2 * (10 + 3)
    ratio.observe(0.5)  # used more than estimated
    assert ratio.value == pytest.approx(0.1 + RATIO_RISE * RATIO_STEP)
    for _ in range(100):
        ratio.raise_for_pressure()
    assert ratio.value == 1.0


def test_the_ratio_settles_near_the_80th_percentile_of_what_requests_use():
    ratio, rng = NewTokenRatio(floor=0.01), random.Random(0)
    seen = []
    for _ in range(3000):
        ratio.observe(rng.random())  # uniform use of max_tokens
        seen.append(ratio.value)
    assert 0.7 <= statistics.mean(seen[1000:]) <= 0.9


def test_estimate_reserves_the_learned_share_and_dispatch_places_that_share_of_each_leg():
    async def scenario():
        worker = FakeWorker(10_000)
        admission = Admission(FakeRegistry(worker), max_running=10, max_queued=4, queue_timeout_s=1)
        admission.ratio.value = 0.25
        req = request(20, 400)
        async with admission.admit(req) as ticket:
            assert ticket.unplaced == 20 + 100 and admission.unplaced == 120
            placement = admission.place(worker, kv_tokens(req))  # dispatch passes prompt + max_tokens
            assert placement.tokens == 120 and worker.kv.reserved == 120 and admission.unplaced == 0
            admission.release(worker, placement)
        full = Admission(FakeRegistry(worker), max_running=10, max_queued=4, queue_timeout_s=1, reserve="full")
        assert full.ratio is None
        async with full.admit(req) as ticket:
            assert ticket.unplaced == 420 and full.place(worker, 420).tokens == 420

    asyncio.run(scenario())


def test_only_completed_requests_teach_the_ratio():
    async def scenario():
        admission = Admission(FakeRegistry(FakeWorker(10_000)), max_running=10, max_queued=4, queue_timeout_s=1)
        async with admission.admit(request(10, 100)):
            pass  # left without completing (the caller sets `generated` only when it did)
        assert admission.ratio.value == 1.0
        async with admission.admit(request(10, 100)) as ticket:
            ticket.generated = 7
        assert admission.ratio.value == pytest.approx(1.0 - RATIO_STEP)

    asyncio.run(scenario())


def test_a_decode_with_legs_waiting_for_pages_raises_the_ratio_a_unified_queue_does_not():
    decode, unified = FakeWorker(1000), FakeWorker(1000, role="unified")
    admission = Admission(FakeRegistry(decode, unified), max_running=10, max_queued=4, queue_timeout_s=1)
    admission.ratio.value = 0.2
    unified.load = WorkerLoad(running=3, waiting=5)  # prompts queued for prefill: not a sign of KV pressure
    admission.on_capacity()
    assert admission.ratio.value == 0.2
    decode.load = WorkerLoad(running=3, waiting=1)
    admission.on_capacity()
    assert admission.ratio.value == pytest.approx(0.2 + RATIO_RISE * RATIO_STEP)


def _burst_peak(reserve: str, requests: int = 24) -> tuple[int, int]:
    """`requests` chat turns of 40 prompt tokens with max_tokens 400 that each really use 10, on a 1,000-token
    pool; each holds its placement a moment. (how many ran at once at most, how many were refused)."""

    async def scenario():
        worker = FakeWorker(1000)
        admission = Admission(FakeRegistry(worker), max_running=100, max_queued=100, queue_timeout_s=10,
                              reserve=reserve)
        running, peak, refused = 0, 0, 0

        async def turn():
            nonlocal running, peak, refused
            req = request(40, 400)
            try:
                async with admission.admit(req) as ticket:
                    placement = admission.place(worker, kv_tokens(req))
                    running += 1
                    peak = max(peak, running)
                    await asyncio.sleep(0.005)
                    running -= 1
                    admission.release(worker, placement)
                    ticket.generated = 10
            except ApiError:
                refused += 1

        await asyncio.gather(*(_elsewhere(turn()) for _ in range(requests)))
        assert admission.running == 0 and admission.unplaced == 0 and worker.kv.reserved == 0
        return peak, refused

    return asyncio.run(scenario())


def test_a_burst_of_short_turns_with_a_large_max_tokens_runs_wider_as_the_estimate_learns():
    assert _burst_peak("full") == (2, 0)  # 440 tokens each: two at a time, however little they use
    peak, refused = _burst_peak("estimate")
    assert refused == 0 and peak >= 5, peak  # 40 + 0.1 x 400 = 80 at the floor: up to 12 at once


def test_the_ratio_is_a_metric():
    from tandem.services.router.metrics import router_metrics

    registry = FakeRegistry(FakeWorker(1000))
    registry.workers = {}  # no worker samples to scrape here
    admission = Admission(registry, max_running=10, max_queued=4, queue_timeout_s=1)
    metrics = router_metrics(registry, admission, lambda: "m")
    admission.ratio.value = 0.3
    assert metrics.registry.get_sample_value("tandem_router_admission_new_token_ratio") == 0.3
    full = Admission(registry, max_running=10, max_queued=4, queue_timeout_s=1, reserve="full")
    assert router_metrics(registry, full, lambda: "m").registry.get_sample_value(
        "tandem_router_admission_new_token_ratio") == 1.0
