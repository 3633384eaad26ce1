"""A request's legs to workers: what a leg is, the GenerateRequest it sends, how a leg fails, and how the
attempt loop reads what its legs' streams queued (deltas merged per sequence, prompt logprobs, the failure
after the tokens before it)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable, Optional, Union

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tandem.common.roles import Role
from tandem.common.rpc.stream_client import Ended, RequestHandle
from tandem.common.transfer.failures import (FAILURE_KIND_METADATA, FAILURE_POLICY, TIMEOUT_FLAGS, Blame, FailureKind,
                                             failure_kind)
from tandem.services.router.errors import ApiError
from tandem.services.router.messages import PromptLogprobs, TokenDelta, TokenRequest
from tandem.services.router.workers import DpRank, Worker

END = object()  # a leg's stream ended normally
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
    on_unhealthy: Optional[Callable[[str], None]] = None  # while it runs: told when its worker's health fails

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


def prompt_logprobs_of(msg) -> Optional[PromptLogprobs]:
    if not msg.HasField("input_logprobs"):
        return None
    lps = msg.input_logprobs
    return PromptLogprobs([e.value if e.HasField("value") else None for e in lps.token_logprobs],
                          [list(zip(row.token_ids, row.values)) for row in lps.top_logprobs])


class SequenceTracker:
    """Tokens seen per sequence, so a GenerateComplete whose tokens did not all arrive as chunks is filled in."""

    def __init__(self):
        self.received: dict[int, int] = {}

    def to_delta(self, resp: pb.GenerateResponse) -> TokenDelta:
        if resp.HasField("chunk"):
            c = resp.chunk
            delta = TokenDelta(c.index, list(c.token_ids), prompt_tokens=c.prompt_tokens,
                               completion_tokens=c.completion_tokens, cached_tokens=c.cached_tokens,
                               prompt_logprobs=prompt_logprobs_of(c))
            if c.HasField("output_logprobs"):  # absent unless the request asked for logprobs
                _fill_logprobs(delta, c.output_logprobs, 0)
        else:
            c = resp.complete
            seen = self.received.get(c.index, 0)
            delta = TokenDelta(c.index, list(c.output_ids[seen:]), finished=True,
                               finish_reason=c.finish_reason or "stop", prompt_tokens=c.prompt_tokens,
                               completion_tokens=c.completion_tokens, cached_tokens=c.cached_tokens,
                               prompt_logprobs=prompt_logprobs_of(c))
            if c.WhichOneof("matched_stop") == "matched_token_id":
                delta.matched_token_id = c.matched_token_id
            if c.HasField("output_logprobs"):
                _fill_logprobs(delta, c.output_logprobs, seen)
        self.received[delta.index] = self.received.get(delta.index, 0) + len(delta.token_ids)
        return delta


def deliver(leg: Leg, queue: asyncio.Queue, item: Union[pb.GenerateResponse, Ended]) -> None:
    """What a leg's request sent (a response, or how it ended), queued for the attempt loop: from its worker's
    Multiplex stream, or a Generate call's failure (`_pump`)."""
    if not isinstance(item, Ended):
        queue.put_nowait((leg, item))
    elif item.code == grpc.StatusCode.OK:
        queue.put_nowait((leg, END))
    else:
        kind = failure_kind(item.trailing.get(FAILURE_KIND_METADATA))
        queue.put_nowait((leg, LegFailure(leg.worker, f"{item.code.name}: {item.details}", item.code, kind)))


def _fill_logprobs(delta: TokenDelta, lps: pb.OutputLogProbs, start: int) -> None:
    delta.logprobs = list(lps.token_logprobs[start:])
    delta.top_logprobs = [list(zip(row.token_ids, row.values)) for row in lps.top_logprobs[start:]]


async def drain(queue: asyncio.Queue) -> list:
    """The next item, and every item already queued behind it."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def read_ready(items: list, token_leg: "Leg", tracker: SequenceTracker, unfinished: int
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
            if leg is not token_leg and tracker.received:
                # The token leg has sent tokens, so the prefill's KV push completed: its leg failing now (its
                # worker killed, its stream broken) changes nothing for the decode.
                leg.done = True
                continue
            if unfinished > 0:  # once every sequence finished, a leg's late failure changes nothing
                return order, prompt_logprobs, item
            continue
        if item is END:
            leg.done = True
            if leg is token_leg and unfinished > 0:
                return order, prompt_logprobs, LegFailure(leg.worker, "the stream ended before every sequence "
                                                                      "completed")
            continue
        if leg is not token_leg:
            prompt_logprobs = prompt_logprobs or prompt_logprobs_of(item.chunk if item.HasField("chunk")
                                                                  else item.complete)
            continue
        delta = tracker.to_delta(item)
        unfinished -= delta.finished
        into = deltas.get(delta.index)
        if into is not None and merge_delta(into, delta):
            continue
        deltas[delta.index] = delta
        order.append(delta)
    return order, prompt_logprobs, None


def merge_delta(into: TokenDelta, delta: TokenDelta) -> bool:
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
