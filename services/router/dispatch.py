"""Dispatch: send a token-level request to a unified worker or a prefill/decode pair, stream its tokens back,
retry on a new worker (pair) while no token has been delivered, abort every leg when the client goes away.

Both modes run the same attempt loop over a list of legs: [unified] or [prefill, decode]. The last leg
carries the client's tokens; a prefill leg contributes only the prompt logprobs and can only fail.
"""

from __future__ import annotations

import asyncio
import logging
import random
from contextlib import aclosing
from dataclasses import dataclass, replace
from functools import partial
from typing import AsyncIterator, Optional, Union

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tandem.common.roles import Role
from tandem.common.rpc.stream_client import Ended, RequestHandle
from tandem.common.telemetry.metrics import RouterMetrics
from tandem.common.telemetry.propagation import inject_grpc
from tandem.common.transfer.failures import (FAILURE_KIND_METADATA, FAILURE_POLICY, TIMEOUT_FLAGS, Blame, FailureKind,
                                      failure_kind)
from tandem.common.telemetry.tracing import add_event, current_span, router_route_span, set_route
from tandem.services.router.admission import Admission, Placement, kv_tokens
from tandem.services.router.config import RouterConfig
from tandem.services.router.errors import ApiError, NoWorkerError
from tandem.services.router.messages import TokenDelta, TokenRequest
from tandem.services.router.policies import RouteRequest, make_policy
from tandem.services.router.workers import DpRank, Worker, WorkerRegistry

logger = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 2.0
PROMPT_LOGPROBS_WAIT_S = 10.0  # how long a finished decode leg waits for its prefill leg's prompt logprobs
_END = object()  # a leg's stream ended normally
# Worker answers that another worker may not give: retry elsewhere.
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL,
              grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED}


class LegFailure(Exception):
    """One leg failed: its gRPC error (with the worker's failure kind when it named one), or a protocol problem
    (stream ended early, worker aborted)."""

    def __init__(self, worker: Worker, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
                 kind: Optional[FailureKind] = None):
        super().__init__(f"{worker.endpoint}: {message}")
        self.worker = worker
        self.code = code
        self.message = message
        self.kind = kind

    @property
    def retryable(self) -> bool:
        if self.kind is not None:
            return FAILURE_POLICY[self.kind].retry
        return self.code in _RETRYABLE

    def blamed(self, legs: list["Leg"]) -> Optional[Worker]:
        """The worker whose breaker this failure counts against, if any: a bad request or our own deadline
        counts against nobody; a transfer failure against the side its kind names."""
        if self.kind is None:
            fault = self.code not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED)
            return self.worker if fault else None
        blame = FAILURE_POLICY[self.kind].blame
        if blame is Blame.REPORTER:
            return self.worker
        if blame is Blame.PEER:
            return next((leg.worker for leg in legs if leg.worker is not self.worker), None)
        return None

    def to_api_error(self) -> ApiError:
        if self.code == grpc.StatusCode.INVALID_ARGUMENT:
            return ApiError(400, self.message)
        if self.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return ApiError(429, f"workers are at capacity: {self.message}", code="worker_capacity")
        if self.kind in TIMEOUT_FLAGS:
            return ApiError(504, f"the KV transfer timed out (the workers' {TIMEOUT_FLAGS[self.kind]}): "
                            f"{self.message}", code="timeout")
        if self.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return ApiError(504, "the request timed out (--request-timeout-s)", code="timeout")
        return ApiError(503, f"worker {self.worker.endpoint.address} failed: {self.message}", code="worker_failed")


@dataclass
class Leg:
    worker: Worker
    role: Role
    # Its own Generate call, or its request on the worker's Multiplex stream.
    call: Union[grpc.aio.UnaryStreamCall, RequestHandle, None] = None
    done: bool = False
    rank: Optional[DpRank] = None  # the DP rank the leg is pinned to (data_parallel_rank), when a policy chose one

    def message(self, message: pb.GenerateRequest) -> pb.GenerateRequest:
        """The leg's own copy of the request when it is pinned to a DP rank (a pair's legs pin each their own)."""
        if self.rank is None:
            return message
        pinned = pb.GenerateRequest()
        pinned.CopyFrom(message)
        pinned.data_parallel_rank = self.rank.dp_rank
        return pinned


def sampling_proto(req: TokenRequest) -> pb.SamplingParams:
    s = req.sampling
    sp = pb.SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty,
        repetition_penalty=s.repetition_penalty, max_new_tokens=req.max_new_tokens,
        stop_token_ids=s.stop_token_ids, skip_special_tokens=s.skip_special_tokens, n=s.n,
        min_new_tokens=s.min_tokens, ignore_eos=s.ignore_eos,
        logit_bias={str(k): v for k, v in s.logit_bias.items()})
    if s.seed is not None:
        sp.custom_params.update({"seed": s.seed})  # agreed convention: SamplingParams has no seed field
    if req.constraint is not None:
        setattr(sp, *req.constraint)  # the constraint oneof: json_schema (response_format, forced tool calls)
    return sp


def generate_proto(req: TokenRequest, request_id: str, prefill: Optional[Worker], room: Optional[int]
                   ) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(
        request_id=request_id, tokenized=pb.TokenizedInput(original_text=req.original_text, input_ids=req.input_ids),
        sampling_params=sampling_proto(req), return_logprob=req.return_logprob or req.prompt_logprobs,
        top_logprobs_num=req.top_logprobs, logprob_start_len=0 if req.prompt_logprobs else -1, stream=True)
    if req.lora_id:  # both legs of a pair run the same adapter
        msg.lora_id = req.lora_id
    if prefill is not None:
        msg.disaggregated_params.CopyFrom(pb.DisaggregatedParams(
            bootstrap_host=prefill.endpoint.host, bootstrap_port=prefill.endpoint.bootstrap_port or 0,
            bootstrap_room=room))
    return msg


def _prompt_logprobs(msg) -> Optional[list[Optional[float]]]:
    if not msg.HasField("input_logprobs"):
        return None
    return [e.value if e.HasField("value") else None for e in msg.input_logprobs.token_logprobs]


class SequenceTracker:
    """Tokens seen per sequence, so a GenerateComplete whose tokens did not all arrive as chunks is filled in."""

    def __init__(self):
        self.received: dict[int, int] = {}

    def to_delta(self, resp: pb.GenerateResponse) -> TokenDelta:
        if resp.HasField("chunk"):
            c = resp.chunk
            delta = TokenDelta(c.index, list(c.token_ids), prompt_tokens=c.prompt_tokens,
                               completion_tokens=c.completion_tokens, cached_tokens=c.cached_tokens,
                               prompt_logprobs=_prompt_logprobs(c))
            if c.HasField("output_logprobs"):  # absent unless the request asked for logprobs
                _fill_logprobs(delta, c.output_logprobs, 0)
        else:
            c = resp.complete
            seen = self.received.get(c.index, 0)
            delta = TokenDelta(c.index, list(c.output_ids[seen:]), finished=True,
                               finish_reason=c.finish_reason or "stop", prompt_tokens=c.prompt_tokens,
                               completion_tokens=c.completion_tokens, cached_tokens=c.cached_tokens,
                               prompt_logprobs=_prompt_logprobs(c))
            if c.WhichOneof("matched_stop") == "matched_token_id":
                delta.matched_token_id = c.matched_token_id
            if c.HasField("output_logprobs"):
                _fill_logprobs(delta, c.output_logprobs, seen)
        self.received[delta.index] = self.received.get(delta.index, 0) + len(delta.token_ids)
        return delta


def _deliver(leg: Leg, queue: asyncio.Queue, item: Union[pb.GenerateResponse, Ended]) -> None:
    """What a leg's request sent (a response, or how it ended), queued for the attempt loop: from its worker's
    Multiplex stream, or a Generate call's failure (`_pump`)."""
    if not isinstance(item, Ended):
        queue.put_nowait((leg, item))
    elif item.code == grpc.StatusCode.OK:
        queue.put_nowait((leg, _END))
    else:
        kind = failure_kind(item.trailing.get(FAILURE_KIND_METADATA))
        queue.put_nowait((leg, LegFailure(leg.worker, f"{item.code.name}: {item.details}", item.code, kind)))


def _fill_logprobs(delta: TokenDelta, lps: pb.OutputLogProbs, start: int) -> None:
    delta.logprobs = list(lps.token_logprobs[start:])
    delta.top_logprobs = [list(zip(row.token_ids, row.values)) for row in lps.top_logprobs[start:]]


async def _drain(queue: asyncio.Queue) -> list:
    """The next item, and every item already queued behind it."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def _read_ready(items: list, token_leg: "Leg", tracker: SequenceTracker, unfinished: int
                ) -> tuple[list[TokenDelta], Optional[list], Optional["LegFailure"]]:
    """What the legs sent since the consumer last looked: the token leg's deltas, one per sequence where several
    queued up (the router fell behind: one detokenization and one SSE chunk for them all), prompt logprobs from
    the prefill leg, and the failure that ended a leg, after the tokens that came before it. `unfinished`: the
    sequences still running before these items (the token leg's stream may end once they all finished)."""
    deltas: dict[int, TokenDelta] = {}
    order: list[TokenDelta] = []
    prompt_logprobs = None
    for leg, item in items:
        if isinstance(item, LegFailure):
            if unfinished > 0:  # once every sequence finished, a leg's late failure changes nothing
                return order, prompt_logprobs, item
            continue
        if item is _END:
            leg.done = True
            if leg is token_leg and unfinished > 0:
                return order, prompt_logprobs, LegFailure(leg.worker, "the stream ended before every sequence "
                                                                      "completed")
            continue
        if leg is not token_leg:
            prompt_logprobs = prompt_logprobs or _prompt_logprobs(item.chunk if item.HasField("chunk")
                                                                  else item.complete)
            continue
        delta = tracker.to_delta(item)
        unfinished -= delta.finished
        into = deltas.get(delta.index)
        if into is not None and _merge(into, delta):
            continue
        deltas[delta.index] = delta
        order.append(delta)
    return order, prompt_logprobs, None


def _merge(into: TokenDelta, delta: TokenDelta) -> bool:
    """Append `delta` to the earlier, unfinished delta of its sequence; an abort stays a delta of its own."""
    if into.finished or delta.finish_reason == "abort" or (delta.prompt_logprobs and into.prompt_logprobs):
        return False
    into.token_ids += delta.token_ids
    into.logprobs += delta.logprobs
    into.top_logprobs += delta.top_logprobs
    into.finished, into.finish_reason, into.matched_token_id = delta.finished, delta.finish_reason, \
        delta.matched_token_id
    into.prompt_tokens = delta.prompt_tokens or into.prompt_tokens
    into.completion_tokens = delta.completion_tokens
    into.cached_tokens = max(into.cached_tokens, delta.cached_tokens)
    into.prompt_logprobs = into.prompt_logprobs or delta.prompt_logprobs
    return True


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
        """A prefill/decode pair when both sides have a healthy worker, else a unified worker; workers that
        already failed this request are avoided while others remain, and of the workers that will hold the
        request's KV (decode, unified) those with room for `reserve` tokens are preferred."""
        def candidates(role: Role) -> list[Worker]:
            workers = [w for w in self.registry.by_role(role) if not route.lora_id or route.lora_id in w.lora_ids()]
            fresh = [w for w in workers if w.endpoint not in exclude] or workers
            if role is Role.PREFILL:
                return fresh
            return [w for w in fresh if w.kv.fits(reserve)] or fresh

        prefill, decode = candidates(Role.PREFILL), candidates(Role.DECODE)
        if prefill and decode:
            # KV computed with one weight version is never decoded with another.
            paired = [p for p in prefill if any(d.weight_version == p.weight_version for d in decode)]
            if not paired:
                raise NoWorkerError("no prefill and decode worker serve the same weight version (prefill: "
                                    f"{sorted({str(p.weight_version) for p in prefill})}, decode: "
                                    f"{sorted({str(d.weight_version) for d in decode})}); finish the update")
            first = self._pick(Role.PREFILL, paired, route)
            decode = [d for d in decode if d.weight_version == first.worker.weight_version]
            return [first, self._pick(Role.DECODE, decode, route, reserve)]
        unified = candidates(Role.UNIFIED)
        if unified:
            return [self._pick(Role.UNIFIED, unified, route, reserve)]
        raise NoWorkerError(self.no_worker_message())

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
            legs = self.pick_legs(route, exclude, reserve)
            if len(legs) == 2:
                set_route(span, prefill=legs[0].worker.endpoint.address, decode=legs[1].worker.endpoint.address,
                          room=room, policy=f"{self.config.prefill_policy}/{self.config.decode_policy}")
                return legs, room
            set_route(span, worker=legs[0].worker.endpoint.address, policy=self.config.policy)
            return legs, None

    async def generate(self, req: TokenRequest) -> AsyncIterator[TokenDelta]:
        route = RouteRequest(req.input_ids, req.lora_id)  # its page hashes are computed once, for every sequence and retry
        if req.sampling.n > 1 and self.registry.by_role(Role.PREFILL) and self.registry.by_role(Role.DECODE):
            stream = self._generate_split(req, route)
        else:
            stream = self._generate_one(req, route)
        async with aclosing(stream) as deltas:
            async for delta in deltas:
                yield delta

    async def _generate_split(self, req: TokenRequest, route: RouteRequest) -> AsyncIterator[TokenDelta]:
        """A prefill/decode pair serves one sequence per room: fan n > 1 out into n requests, each with its
        own room (and seed + i, as the engine seeds its own siblings), and merge them back by index."""
        n, seed = req.sampling.n, req.sampling.seed
        subs = [replace(req, request_id=f"{req.request_id}-n{i}",
                        sampling=replace(req.sampling, n=1, seed=None if seed is None else seed + i))
                for i in range(n)]
        queue: asyncio.Queue = asyncio.Queue()

        async def run(index: int, sub: TokenRequest) -> None:
            try:
                async with aclosing(self._generate_one(sub, route)) as deltas:
                    async for delta in deltas:
                        delta.index = index
                        queue.put_nowait(delta)
                queue.put_nowait(None)
            except Exception as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
                queue.put_nowait(e)

        tasks = [asyncio.create_task(run(i, sub)) for i, sub in enumerate(subs)]
        try:
            done = 0
            while done < n:
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

    async def _generate_one(self, req: TokenRequest, route: RouteRequest) -> AsyncIterator[TokenDelta]:
        attempts = self.config.max_retries + 1
        failed: set = set()
        for attempt in range(attempts):
            legs, room = self.route(route, failed, kv_tokens(req))
            request_id = req.request_id if attempt == 0 else f"{req.request_id}-retry{attempt}"
            delivered = False
            try:
                async with aclosing(self._attempt(legs, req, request_id, room)) as deltas:
                    async for delta in deltas:
                        delivered = True
                        yield delta
                return
            except LegFailure as failure:
                failed.add((failure.blamed(legs) or failure.worker).endpoint)
                if delivered or not failure.retryable or attempt == attempts - 1:
                    raise failure.to_api_error() from None
                logger.warning("request %s: %s; retrying (%d/%d)", req.request_id, failure, attempt + 1,
                               attempts - 1)
                add_event(current_span(), "retry", {"tandem.attempt": attempt + 1, "tandem.error": str(failure)})
                self.metrics.retries.inc()

    async def _attempt(self, legs: list[Leg], req: TokenRequest, request_id: str, room: Optional[int]
                       ) -> AsyncIterator[TokenDelta]:
        """One try on one worker (pair): start the legs, stream the token leg's deltas, then settle the legs
        however the try ended (counts and KV reservation released, breakers told, unfinished legs aborted)."""
        queue: asyncio.Queue = asyncio.Queue()
        pumps = self._start_legs(legs, generate_proto(req, request_id, legs[0].worker if len(legs) == 2 else None,
                                                      room), queue)
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
            self._release(legs, placement)
            self._record_results(legs, ok, failure)
            self._stop_legs(legs, pumps, request_id, ok, failure)

    def _start_legs(self, legs: list[Leg], message: pb.GenerateRequest, queue: asyncio.Queue) -> list[asyncio.Task]:
        """Send each leg its request: on its worker's Multiplex stream, or as a Generate call read by a pump
        task (returned). Each leg counts as in flight on its worker (and DP rank) until `_release`."""
        # The router's request span is the parent of the workers' spans (no metadata when tracing is off).
        trace_context = {"metadata": metadata} if (metadata := inject_grpc()) else {}
        pumps = []
        for leg in legs:
            leg.worker.in_flight += 1
            if leg.rank is not None:
                leg.rank.in_flight += 1
            leg.worker.breaker.begin()
            if self.config.worker_stream and leg.worker.generate_stream:
                leg.call = leg.worker.stream.start(leg.message(message), partial(_deliver, leg, queue),
                                                   self.config.request_timeout_s, trace_context.get("metadata"))
            else:
                leg.call = leg.worker.stub.Generate(leg.message(message), timeout=self.config.request_timeout_s,
                                                    **trace_context)
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
            deltas, seen_logprobs, ended = _read_ready(await _drain(queue), token_leg, tracker,
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
            if item is _END:
                leg.done = True
                break
            found = _prompt_logprobs(item.chunk if item.HasField("chunk") else item.complete)
            if found is not None:
                return found
        return None

    async def _pump(self, leg: Leg, queue: asyncio.Queue) -> None:
        try:
            async for response in leg.call:
                queue.put_nowait((leg, response))
            queue.put_nowait((leg, _END))
        except grpc.aio.AioRpcError as e:  # queued as a stream request's failure is (`_deliver`)
            _deliver(leg, queue, Ended(e.code(), e.details() or "", dict(e.trailing_metadata() or ())))
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

