"""Dispatch: send a token-level request to a unified worker or a prefill/decode pair, stream its tokens back,
retry on a new worker (pair) while no token has been delivered, migrate the request to one after (the delivered
tokens carried), abort every leg when the client goes away.

Both modes run the same attempt loop over a list of legs: [unified] or [prefill, decode]. The last leg
carries the client's tokens; a prefill leg contributes only the prompt logprobs and can only fail.
"""

from __future__ import annotations

import asyncio
import logging
import random
from contextlib import aclosing
from dataclasses import replace
from functools import partial
from typing import AsyncIterator, Optional

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tandem.common.roles import Role
from tandem.common.rpc.stream_client import Ended
from tandem.common.telemetry.metrics import RouterMetrics
from tandem.common.telemetry.propagation import inject_grpc
from tandem.common.telemetry.tracing import add_event, current_span, router_route_span, set_route
from tandem.services.router.admission import Admission, Placement, kv_tokens
from tandem.services.router.config import RouterConfig
from tandem.services.router.disagg import Decision, DisaggThresholds, best_cached, decide, signals_for
from tandem.services.router.errors import ApiError, NoWorkerError
from tandem.services.router.legs import (END, Leg, LegFailure, SequenceTracker, deliver, drain, generate_proto,
                                         prompt_logprobs_of, read_ready)
from tandem.services.router.messages import TokenDelta, TokenRequest
from tandem.services.router.migration import (Continuation, HealthLost, Progress, exhausted, migration_reason,
                                              no_other_worker)
from tandem.services.router.policies import RouteRequest, make_policy
from tandem.services.router.workers import DpRank, Worker, WorkerRegistry

logger = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 2.0
PROMPT_LOGPROBS_WAIT_S = 10.0  # how long a finished decode leg waits for its prefill leg's prompt logprobs


class Dispatcher:
    def __init__(self, registry: WorkerRegistry, config: RouterConfig, metrics: Optional[RouterMetrics] = None,
                 admission: Optional[Admission] = None):
        self.registry = registry
        self.config = config
        self.admission = admission  # KV reservations of the legs that hold a request's KV (decode, unified)
        self.metrics = metrics or RouterMetrics(enabled=False)
        args = (config.balance_abs_threshold, config.balance_rel_threshold)
        self.policies = {Role.UNIFIED: make_policy(config.policy, *args),
                         Role.PREFILL: make_policy(config.prefill_policy, *args),
                         Role.DECODE: make_policy(config.decode_policy, *args)}
        self.disagg_limits = DisaggThresholds(config.local_prefill_max_tokens, config.prefill_saturated_queue,
                                              config.local_prefill_min_free_kv, config.local_prefill_max_waiting)
        self._background: set[asyncio.Task] = set()

    def _pick(self, role: Role, workers: list[Worker], route: RouteRequest, reserve: Optional[int] = None) -> Leg:
        """One leg of `role`: a worker, or under a policy that sees DP ranks a (worker, rank) pinned by
        data_parallel_rank; for a KV-holding leg (`reserve` set) ranks with room for `reserve` tokens first."""
        policy = self.policies[role]
        if not policy.sees_dp_ranks:
            return Leg(policy.pick(workers, route), role)
        targets = [t for w in workers for t in w.routing_targets()]
        if reserve is not None:
            targets = [t for t in targets if t.kv.fits(reserve)] or targets
        target = policy.pick(targets, route)
        return Leg(target.worker, role, rank=target if isinstance(target, DpRank) else None)

    def pick_legs(self, route: RouteRequest, exclude: set, reserve: int = 0) -> list[Leg]:
        """The legs of one attempt; see `pick_route`."""
        return self.pick_route(route, exclude, reserve)[0]

    def pick_route(self, route: RouteRequest, exclude: set, reserve: int = 0) -> tuple[list[Leg], Optional[Decision]]:
        """A prefill/decode pair, or a decode worker alone that prefills the prompt itself (--disagg-policy decides
        which, and does whenever no prefill worker is available), else a unified worker; with the pair-or-local
        decision when a decode serves. Workers that already failed this request are avoided while others remain,
        and of the workers that will hold the request's KV (decode, unified) those with room for `reserve` tokens
        are preferred."""
        def candidates(role: Role) -> list[Worker]:
            workers = [w for w in self.registry.by_role(role) if not route.lora_id or route.lora_id in w.lora_ids()]
            fresh = [w for w in workers if w.endpoint not in exclude] or workers
            if role is Role.PREFILL:
                return fresh
            home = [w for w in fresh if w.endpoint == route.home]
            if home:  # a session's worker holds its earlier turns' KV pinned
                return home
            return [w for w in fresh if w.kv.fits(reserve)] or fresh

        prefill, decode = candidates(Role.PREFILL), candidates(Role.DECODE)
        # KV computed with one weight version is never decoded with another.
        paired = [p for p in prefill if any(d.weight_version == p.weight_version for d in decode)]
        local = [d for d in decode if d.local_prefill]
        if local:
            # A prefill that already failed this request is not retried while the decode can prefill it.
            paired = [p for p in paired if p.endpoint not in exclude]
            best, cached = best_cached(local, route)
            decision = decide(self.config.disagg_policy, self.disagg_limits, signals_for(route, paired, best, cached))
            self.metrics.disagg_decisions.labels(decision.decision, decision.reason).inc()
            if decision.local:  # a cached prefix is worth most on the decode that holds it
                leg = Leg(best, Role.DECODE) if decision.reason == "cached_prefix" else \
                    self._pick(Role.DECODE, local, route, reserve)
                return [leg], decision
            return self._pair(route, paired, decode, reserve), decision
        if prefill and decode:
            if not paired:
                raise NoWorkerError("no prefill and decode worker serve the same weight version (prefill: "
                                    f"{sorted({str(p.weight_version) for p in prefill})}, decode: "
                                    f"{sorted({str(d.weight_version) for d in decode})}); finish the update")
            return self._pair(route, paired, decode, reserve), None
        unified = candidates(Role.UNIFIED)
        if unified:
            return [self._pick(Role.UNIFIED, unified, route, reserve)], None
        raise NoWorkerError(self.no_worker_message())

    def _pair(self, route: RouteRequest, prefill: list[Worker], decode: list[Worker], reserve: int) -> list[Leg]:
        """A prefill (of `prefill`, each serving some decode's weight version) and a decode of its version."""
        first = self._pick(Role.PREFILL, prefill, route)
        decode = [d for d in decode if d.weight_version == first.worker.weight_version]
        return [first, self._pick(Role.DECODE, decode, route, reserve)]

    def no_worker_message(self) -> str:
        workers = self.registry.workers.values()
        if not workers:
            return "no workers are registered (yet)"
        states = "; ".join(f"{w.endpoint}: {'breaker ' + w.breaker.state if w.healthy else w.health_message}"
                           for w in workers)
        return f"no healthy worker (or prefill/decode pair) is available: {states}"

    def route(self, route: RouteRequest, exclude: set, reserve: int = 0) -> tuple[list[Leg], Optional[int]]:
        """Pick the legs of one attempt (a traced step) and, for a pair, the bootstrap room they share."""
        room = random.randrange(0, 2**31)
        with router_route_span() as span:
            legs, decision = self.pick_route(route, exclude, reserve)
            why = {"disagg": decision.decision, "disagg_reason": decision.reason} if decision else {}
            if len(legs) == 2:
                set_route(span, prefill=legs[0].worker.endpoint.address, decode=legs[1].worker.endpoint.address,
                          room=room, policy=f"{self.config.prefill_policy}/{self.config.decode_policy}", **why)
                return legs, room
            if legs[0].role is Role.DECODE:
                set_route(span, decode=legs[0].worker.endpoint.address, policy=self.config.decode_policy, **why)
                return legs, None
            set_route(span, worker=legs[0].worker.endpoint.address, policy=self.config.policy)
            return legs, None

    async def generate(self, req: TokenRequest) -> AsyncIterator[TokenDelta]:
        # Its page hashes are computed once, for every sequence and retry.
        route = RouteRequest(req.input_ids, req.lora_id, home=req.session.home if req.session else None)
        if req.sampling.n > 1 and self.registry.by_role(Role.PREFILL) and self.registry.by_role(Role.DECODE):
            # A prefill/decode pair serves one sequence per room: n > 1 fans out into n requests.
            subs = [sequence_request(req, i) for i in range(req.sampling.n)]
            stream = self._merged({i: self._generate_one(sub, route, Progress.of(sub)) for i, sub in enumerate(subs)})
        else:
            stream = self._generate_one(req, route, Progress.of(req))
        async with aclosing(stream) as deltas:
            async for delta in deltas:
                yield delta

    async def _merged(self, streams: dict[int, AsyncIterator[TokenDelta]]) -> AsyncIterator[TokenDelta]:
        """Sequences served as requests of their own (n = 1 each), merged back into one request's by index."""
        queue: asyncio.Queue = asyncio.Queue()

        async def run(index: int, stream: AsyncIterator[TokenDelta]) -> None:
            try:
                async with aclosing(stream) as deltas:
                    async for delta in deltas:
                        delta.index = index
                        queue.put_nowait(delta)
                queue.put_nowait(None)
            except Exception as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
                queue.put_nowait(e)

        tasks = [asyncio.create_task(run(i, stream)) for i, stream in streams.items()]
        try:
            done = 0
            while done < len(tasks):
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item is None:
                    done += 1
                    continue
                yield item
        finally:
            for task in tasks:
                task.cancel()  # closing a sub-stream aborts its legs on both workers
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _generate_one(self, req: TokenRequest, route: RouteRequest, progress: Progress,
                            failed: Optional[set] = None, deadline: Optional[float] = None
                            ) -> AsyncIterator[TokenDelta]:
        """Attempts until every sequence finished. A failure before any token reached the client is retried on
        another worker (pair) (--max-retries); after, the request migrates (--max-migrations): the delivered
        tokens join the prompt of a continuation on another worker (pair), and the stream goes on."""
        loop = asyncio.get_running_loop()
        deadline = deadline or loop.time() + self.config.request_timeout_s
        failed = set() if failed is None else failed
        attempt, retries = 0, 0
        while True:
            continuation = Continuation.of(req, progress)
            if continuation.spent:  # the last token came, its ending did not: it ended at its length
                yield continuation.length_end()
                return
            legs, room = self.route(route, failed, kv_tokens(continuation.request))
            if progress.failure is not None and legs[-1].worker.endpoint in failed:
                raise no_other_worker(progress.failure)  # fast: no waiting for the failed worker to come back
            if loop.time() >= deadline:
                raise ApiError(504, "the request timed out (--request-timeout-s)", code="timeout")
            kind = "migrated" if progress.delivered else "retry"
            request_id = req.request_id if attempt == 0 else f"{req.request_id}-{kind}{attempt}"
            metadata = continuation.metadata
            if req.session is not None:  # the token leg's worker pins the turn's KV for the session
                req.session.worker = legs[-1].worker.endpoint
                metadata = metadata + req.session.metadata()
            try:
                async with aclosing(self._attempt(legs, continuation.request, request_id, room,
                                                  metadata, deadline - loop.time())) as deltas:
                    async for delta in deltas:
                        delta = continuation.as_original(delta)
                        progress.record(delta)
                        yield delta
                return
            except LegFailure as failure:
                attempt += 1
                failed.add((failure.blamed(legs) or failure.worker).endpoint)
                if not progress.delivered:
                    if not failure.retryable or retries == self.config.max_retries:
                        raise failure.to_api_error() from None
                    retries += 1
                    logger.warning("request %s: %s; retrying (%d/%d)", req.request_id, failure, retries,
                                   self.config.max_retries)
                    add_event(current_span(), "retry", {"tandem.attempt": attempt, "tandem.error": str(failure)})
                    self.metrics.retries.inc()
                    continue
                if not failure.retryable or progress.migrations >= self.config.max_migrations:
                    raise exhausted(failure, progress.migrations) from None
                self._note_migration(req, failure, progress, attempt)
            if req.sampling.n > 1:  # each unfinished sequence goes on as a request of its own
                async with aclosing(self._merged({i: self._generate_one(sequence_request(req, i), route,
                                                                        progress.sequence(i), set(failed), deadline)
                                                  for i in progress.unfinished()})) as deltas:
                    async for delta in deltas:
                        yield delta
                return

    def _note_migration(self, req: TokenRequest, failure: LegFailure, progress: Progress, attempt: int) -> None:
        """Count a migration against the request's budget; log it, trace it, and count it by reason."""
        progress.migrations, progress.failure = progress.migrations + 1, failure
        reason, carried = migration_reason(failure), sum(map(len, progress.outputs.values()))
        logger.warning("request %s: %s after %d delivered token(s); migrating (%d/%d)", req.request_id, failure,
                       carried, progress.migrations, self.config.max_migrations)
        add_event(current_span(), "migration", {"tandem.attempt": attempt, "tandem.reason": reason,
                                                "tandem.worker": failure.worker.endpoint.address,
                                                "tandem.carried_tokens": carried, "tandem.error": str(failure)})
        self.metrics.migrations.labels(reason).inc()

    async def _attempt(self, legs: list[Leg], req: TokenRequest, request_id: str, room: Optional[int],
                       metadata: list[tuple[str, str]], timeout: float) -> AsyncIterator[TokenDelta]:
        """One try on one worker (pair): start the legs, stream the token leg's deltas, then settle the legs
        however the try ended (counts and KV reservation released, breakers told, unfinished legs aborted)."""
        queue: asyncio.Queue = asyncio.Queue()
        pumps = self._start_legs(legs, generate_proto(req, request_id, legs[0].worker if len(legs) == 2 else None,
                                                      room), queue, metadata, timeout)
        placement = self._admit(legs[-1], req)
        ok, failure = False, None
        try:
            async with aclosing(self._deltas(legs, req, queue)) as deltas:
                async for delta in deltas:
                    yield delta
            ok = True
        except LegFailure as e:
            failure = e
            raise
        finally:
            for leg in legs:
                leg.worker.on_unhealthy.discard(leg.on_unhealthy)
            self._release(legs, placement)
            self._record_results(legs, ok, failure)
            self._stop_legs(legs, pumps, request_id, ok, failure)

    def _start_legs(self, legs: list[Leg], message: pb.GenerateRequest, queue: asyncio.Queue,
                    metadata: list[tuple[str, str]], timeout: float) -> list[asyncio.Task]:
        """Send each leg its request (with `metadata`): on its worker's Multiplex stream, or as a Generate call
        read by a pump task (returned). Each leg counts as in flight on its worker (and DP rank) until
        `_release`, and fails if its worker's health check fails meanwhile."""
        # The router's request span is the parent of the workers' spans (no trace context when tracing is off).
        metadata = inject_grpc(list(metadata) or None)
        call_metadata = {"metadata": metadata} if metadata else {}
        pumps = []
        for leg in legs:
            leg.on_unhealthy = partial(lost_health, leg, queue)
            leg.worker.on_unhealthy.add(leg.on_unhealthy)
            leg.worker.in_flight += 1
            if leg.rank is not None:
                leg.rank.in_flight += 1
            leg.worker.breaker.begin()
            if self.config.worker_stream and leg.worker.generate_stream:
                leg.call = leg.worker.stream.start(leg.message(message), partial(deliver, leg, queue), timeout,
                                                   metadata)
            else:
                leg.call = leg.worker.stub.Generate(leg.message(message), timeout=timeout, **call_metadata)
                pumps.append(asyncio.create_task(self._pump(leg, queue)))
            self.metrics.sent_to(leg.worker.endpoint.address, leg.role)
        return pumps

    def _admit(self, token_leg: Leg, req: TokenRequest) -> Optional[Placement]:
        """Reserve the request's KV tokens on the leg that holds them (the token leg); None without admission."""
        if self.admission is None:
            return None
        return self.admission.place(token_leg.worker, kv_tokens(req), token_leg.rank)

    async def _deltas(self, legs: list[Leg], req: TokenRequest, queue: asyncio.Queue) -> AsyncIterator[TokenDelta]:
        """The token leg's deltas until every sequence finished; the failure that ends a leg raises. A finished
        sequence carries the prompt logprobs asked for, from the prefill leg (waited for if still to come)."""
        token_leg, tracker = legs[-1], SequenceTracker()
        prompt_logprobs: Optional[list] = None
        finished: set[int] = set()
        while len(finished) < req.sampling.n:
            deltas, seen_logprobs, ended = read_ready(await drain(queue), token_leg, tracker,
                                                       req.sampling.n - len(finished))
            prompt_logprobs = prompt_logprobs or seen_logprobs
            for delta in deltas:
                delta.weight_version = token_leg.worker.weight_version  # PD: both legs' match (pick_legs)
                if delta.finished:
                    if delta.finish_reason == "abort":
                        raise LegFailure(token_leg.worker, "the worker aborted the request", grpc.StatusCode.ABORTED)
                    finished.add(delta.index)
                    if req.prompt_logprobs and delta.prompt_logprobs is None and len(legs) == 2:
                        prompt_logprobs = prompt_logprobs or await self._await_prefill(legs[0], queue)
                        delta.prompt_logprobs = prompt_logprobs
                yield delta
            if ended is not None:
                raise ended

    def _release(self, legs: list[Leg], placement: Optional[Placement]) -> None:
        """The try is over: its legs leave their workers' (and ranks') in-flight counts, its KV reservation goes."""
        for leg in legs:
            leg.worker.in_flight -= 1
            if leg.rank is not None:
                leg.rank.in_flight -= 1
        if placement is not None:
            token_leg = legs[-1]
            self.admission.release(token_leg.worker, placement, token_leg.rank)

    def _record_results(self, legs: list[Leg], ok: bool, failure: Optional[LegFailure]) -> None:
        """The breakers: a failure counts against the worker it blames; a success for every leg."""
        blamed = failure.blamed(legs) if failure is not None else None
        for leg in legs:
            if blamed is leg.worker:
                leg.worker.record_result(False)
            elif ok:
                leg.worker.record_result(True)

    def _stop_legs(self, legs: list[Leg], pumps: list[asyncio.Task], request_id: str, ok: bool,
                   failure: Optional[LegFailure]) -> None:
        """Stop reading the legs; a leg that did not end on its own is aborted on its worker too."""
        for pump in pumps:
            pump.cancel()
        for leg in legs:
            if leg.call is not None:
                leg.call.cancel()  # an ended call ignores it; a stream request's deadline timer stops
                if not leg.done and not ok:
                    self._abort_later(leg, request_id, "router: " + (str(failure) if failure else "cancelled"))

    async def _await_prefill(self, leg: Leg, queue: asyncio.Queue) -> Optional[list]:
        """The decode leg finished first; wait a little for the prefill leg's prompt logprobs."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PROMPT_LOGPROBS_WAIT_S
        while not leg.done and loop.time() < deadline:
            try:
                source, item = await asyncio.wait_for(queue.get(), deadline - loop.time())
            except asyncio.TimeoutError:
                break
            if source is not leg or isinstance(item, LegFailure):
                continue
            if item is END:
                leg.done = True
                break
            found = prompt_logprobs_of(item.chunk if item.HasField("chunk") else item.complete)
            if found is not None:
                return found
        return None

    async def _pump(self, leg: Leg, queue: asyncio.Queue) -> None:
        try:
            async for response in leg.call:
                queue.put_nowait((leg, response))
            queue.put_nowait((leg, END))
        except grpc.aio.AioRpcError as e:  # queued as a stream request's failure is (`deliver`)
            deliver(leg, queue, Ended(e.code(), e.details() or "", dict(e.trailing_metadata() or ())))
        except asyncio.CancelledError:
            pass

    def _abort_later(self, leg: Leg, request_id: str, reason: str) -> None:
        """Tell the worker to free the request now; cancelling the stream does too, this covers a leg whose
        stream already handed over (prefill) or a worker that missed the cancellation."""
        async def abort() -> None:
            try:
                await leg.worker.stub.Abort(pb.AbortRequest(request_id=request_id, reason=reason[:200]),
                                            timeout=ABORT_TIMEOUT_S)
            except grpc.aio.AioRpcError:
                pass  # the worker is gone; nothing left to free there

        task = asyncio.get_running_loop().create_task(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def sequence_request(req: TokenRequest, index: int) -> TokenRequest:
    """Sequence `index` of an n > 1 request as a request of its own: seed + index, as the engine seeds its
    sibling `index`, so it draws what that sibling would have."""
    seed = req.sampling.seed
    return replace(req, request_id=f"{req.request_id}-n{index}",
                   sampling=replace(req.sampling, n=1, seed=None if seed is None else seed + index))


def lost_health(leg: Leg, queue: asyncio.Queue, message: str) -> None:
    """The leg's worker failed its health check: the leg fails as its stream breaking would have made it."""
    queue.put_nowait((leg, HealthLost(leg.worker, f"health check failed: {message}")))
