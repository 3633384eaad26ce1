"""Messages between an engine's callers and its scheduler: requests in, token chunks out."""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from tandem.common.sampling.params import SamplingParams
from tandem.common.telemetry.tracing import NOOP_TRACE
from tandem.common.transfer.failures import TransferFailure

if TYPE_CHECKING:
    from tandem.common.scheduler.sessions import SessionTag

# Call metadata of a resumed request (request migration): "the last K tokens of input_ids are this request's own
# output so far". Parsed at the gRPC edge by common/rpc/resume.py, which the router imports it from.
RESUMED_OUTPUT_TOKENS_KEY = "tandem-resumed-output-tokens"


@dataclass
class GenerateRequest:
    """A token-level generation request, as the workers' gRPC servicers and the offline CLI submit it."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # >= 0: also return prompt-token logprobs from this position on
    stream: bool = True
    # Prefill/decode pairing (both legs carry the same room; host/port name the prefill's bootstrap server).
    bootstrap_host: Optional[str] = None
    bootstrap_port: Optional[int] = None
    bootstrap_room: Optional[int] = None
    lora_id: Optional[str] = None  # a loaded LoRA adapter's name; None: the base model
    # A LoRA adapter (common/model/lora.py LoRAAdapter) resolved from the request's lora_id by Engine.submit.
    lora: object = field(default=None, repr=False, compare=False)
    # The worker's RequestTrace (NOOP_TRACE when tracing is off); the scheduler thread records marks on it.
    trace: object = field(default=NOOP_TRACE, repr=False, compare=False)
    received_at: float = field(default_factory=time.monotonic, repr=False, compare=False)  # made (submitted)
    # A resumed request: its last K input_ids are its own output so far (grammar, penalties, min_new_tokens).
    resumed_output_tokens: int = 0
    # A session's turn: its KV stays pinned once it finishes (common/scheduler/sessions.py).
    session: Optional["SessionTag"] = None


@dataclass
class FinishReason:
    kind: str  # "stop" | "length" | "abort"
    matched: Optional[int] = None  # the stop token id that ended the request
    message: str = ""  # why an abort happened

    def to_dict(self) -> dict:
        out: dict = {"type": self.kind}
        if self.matched is not None:
            out["matched"] = self.matched
        if self.message:
            out["message"] = self.message
        return out


@dataclass(frozen=True)
class RequestError:
    """Why a request failed inside a worker, set where it failed."""

    message: str
    grpc_code: str = "INTERNAL"  # gRPC status name the servicer answers with
    failure_kind: Optional[str] = None  # a FailureKind word (common/transfer/failures.py) for the caller's decision

    @classmethod
    def of_transfer(cls, room: Optional[int], failure: TransferFailure) -> "RequestError":
        return cls(f"KV transfer for room {room} failed: {failure.message}", failure.policy.grpc_code,
                   failure.kind.value)


@dataclass
class TokenOutput:
    """New tokens of one sequence since its previous chunk; the last chunk has `finished` set."""

    rid: str
    index: int  # which of the request's n sequences
    token_ids: list[int]
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None
    finished: bool = False
    finish_reason: Optional[FinishReason] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    input_logprobs: Optional[list[Optional[float]]] = None  # first chunk only, when asked
    input_top_logprobs: Optional[list[list[tuple[int, float]]]] = None  # with it, when top_logprobs_num > 0
    error: Optional[RequestError] = None  # set when the request failed inside the engine


def coalesce(outputs: list[TokenOutput]) -> list[TokenOutput]:
    """Outputs of one request queued together, one per sequence: each sequence's new tokens (and logprobs) in
    order, with the latest counts and ending. What a consumer that fell behind sends as one message. The first
    output of each sequence is extended in place: a request's outputs belong to its one consumer."""
    if len(outputs) == 1:
        return outputs
    merged: dict[int, TokenOutput] = {}
    for out in outputs:
        into = merged.get(out.index)
        if into is None:
            merged[out.index] = out
            continue
        into.token_ids = into.token_ids + out.token_ids
        if out.logprobs is not None:
            into.logprobs = (into.logprobs or []) + out.logprobs
        if out.top_logprobs is not None:
            into.top_logprobs = (into.top_logprobs or []) + out.top_logprobs
        if into.input_logprobs is None:
            into.input_logprobs, into.input_top_logprobs = out.input_logprobs, out.input_top_logprobs
        into.finished, into.finish_reason, into.error = out.finished, out.finish_reason, out.error
        into.prompt_tokens, into.completion_tokens = out.prompt_tokens, out.completion_tokens
        into.cached_tokens = max(into.cached_tokens, out.cached_tokens)
    return list(merged.values())


class StreamInterval:
    """`--stream-interval N` (SGLang's name) for one streamed request: a sequence's first token goes out at once
    (TTFT is unchanged), later tokens once N are pending, and whatever is pending when the sequence ends. One
    message per N steps instead of one per step: less CPU per token in the worker's gRPC sends, the router and the
    client, in exchange for burstier text. N = 1 passes every batch through."""

    def __init__(self, interval: int):
        self.interval = interval
        self.held: dict[int, list[TokenOutput]] = {}
        self.held_tokens: dict[int, int] = {}  # tokens in `held`, kept as a count: no re-summing per output
        self.started: set[int] = set()

    def release(self, batch: list[TokenOutput]) -> list[TokenOutput]:
        """The outputs of `batch` and those held before it that are due now, in order; the rest are held."""
        if self.interval <= 1:
            return batch
        due: list[TokenOutput] = []
        for out in batch:
            pending = self.held.setdefault(out.index, [])
            pending.append(out)
            count = self.held_tokens.get(out.index, 0) + len(out.token_ids)
            first = out.index not in self.started and bool(out.token_ids)
            if first or out.finished or out.error is not None or out.input_logprobs is not None \
                    or count >= self.interval:
                due += pending
                self.held[out.index], count = [], 0
                self.started.add(out.index)
            self.held_tokens[out.index] = count
        return due


@dataclass
class EmbedRequest:
    """Pool one prompt's final hidden states into an embedding; the scheduler completes `result` (an EmbedOutput)."""

    rid: str
    input_ids: list[int]
    result: concurrent.futures.Future = field(default_factory=concurrent.futures.Future, repr=False, compare=False)


@dataclass
class EmbedOutput:
    embedding: list[float]  # L2-normalised
    prompt_tokens: int


@dataclass
class AbortRequest:
    rid: str
    message: str = "aborted by client"


@dataclass
class SequenceResult:
    """What one of a request's n sequences has produced so far, accumulated from its TokenOutputs."""

    index: int
    output_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[FinishReason] = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs: Optional[list[Optional[float]]] = None
    input_top_logprobs: Optional[list[list[tuple[int, float]]]] = None

    def add(self, out: TokenOutput) -> None:
        self.output_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs or [])
        self.top_logprobs.extend(out.top_logprobs or [])
        if out.input_logprobs is not None:
            self.input_logprobs, self.input_top_logprobs = out.input_logprobs, out.input_top_logprobs
        if out.finished:
            self.finish_reason = out.finish_reason
