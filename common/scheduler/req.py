"""Req: one sequence's life inside a scheduler — its tokens, KV slots, cache node and finish state."""

from __future__ import annotations

import time
from typing import Optional, Protocol

import torch

from tandem.common.sampling.grammar import GrammarBackend, RequestGrammar
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import FinishReason, GenerateRequest, RequestError
from tandem.common.telemetry.tracing import NOOP_TRACE

_EMPTY = torch.empty(0, dtype=torch.int64)


class KVTransfer(Protocol):
    """What the scheduler's shared code needs of a request's KV transfer: a way to abort it."""

    def abort(self, reason: str) -> None: ...


class Req:
    """One sequence (a request with n > 1 becomes n Reqs sharing a `group_rid`)."""

    def __init__(
        self,
        rid: str,
        index: int,
        origin_input_ids: list[int],
        sampling_params: SamplingParams,
        stop_ids: set[int],
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        max_context_len: int = 1 << 30,
        resumed_len: int = 0,
    ):
        self.rid = rid
        self.index = index
        self.origin_input_ids = list(origin_input_ids)
        self.sampling_params = sampling_params
        self.stop_ids = stop_ids
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        self.logprob_start_len = logprob_start_len
        self.max_context_len = max_context_len
        # Seeded sampling: sibling i draws from seed + i; each draw depends on this seed and the token's position.
        self.seed: Optional[int] = None if sampling_params.seed is None else int(sampling_params.seed) + index
        # A resumed request's last `resumed_len` prompt tokens are its own output so far (common/rpc/resume.py).
        self.resumed_len = resumed_len
        self.session = None  # a session's turn (SessionTag): its KV stays pinned once it finishes

        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        self.input_logprobs: dict[int, float] = {}  # prompt position -> logprob, filled per chunk
        self.input_top_logprobs: dict[int, list[tuple[int, float]]] = {}  # prompt position -> its top-k
        self.input_logprobs_sent = False

        # Memory state.
        self.req_pool_idx: Optional[int] = None
        self.prefix_indices: torch.Tensor = _EMPTY  # KV slots of the prefix held by the tree cache
        self.last_node = None  # tree node locked on behalf of this request
        self.fill_ids: list[int] = []  # tokens whose KV must exist after the current extend
        self.extend_input_len = 0
        self.kv_len = 0  # tokens whose KV is (or is being) written to the pool
        self.is_chunked = False
        self.cached_tokens = 0  # prefix-cache hit of the first match, for usage reporting
        self.matched_once = False
        self.loaded_tokens = {"host": 0, "disk": 0}  # HiCache: prefix tokens its matches loaded from each tier

        # Life-cycle state.
        self.finished_reason: Optional[FinishReason] = None
        self.to_abort: Optional[str] = None
        self.room: Optional[int] = None  # bootstrap room of a prefill/decode leg
        # This request's KV transfer on a disaggregated worker (a KVSender or KVReceiver), None elsewhere.
        self.transfer: Optional[KVTransfer] = None
        self.error: Optional[RequestError] = None  # set where the request failed
        self.is_retracted = False
        self.epoch = 0  # bumped on retraction so in-flight results for the old attempt are dropped
        self.pending_future: Optional[int] = None  # overlap loop: slot of a token not yet processed
        self.blocked_by: Optional["Req"] = None  # n > 1: wait until the first sibling cached the prompt
        self.prefill_done = False
        self.sent_len = 0  # output tokens already streamed
        self.arrival_time = time.monotonic()
        self.first_token_time: Optional[float] = None
        self.trace = NOOP_TRACE  # the worker's RequestTrace for this request (set by the scheduler)
        self.lora = None  # its LoRAAdapter, or None for the base model
        # Constrained decoding: the compiled constraint and this sequence's matcher, advanced with each token.
        self.grammar: Optional["RequestGrammar"] = None

    # ---- token bookkeeping -------------------------------------------------------------------

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def resumed_ids(self) -> list[int]:
        return self.origin_input_ids[len(self.origin_input_ids) - self.resumed_len:]

    @property
    def generated_len(self) -> int:
        """Output tokens so far, counting those a resumed request carries at the end of its prompt."""
        return self.resumed_len + len(self.output_ids)

    def generated_ids(self) -> list[int]:
        """What penalties and min_new_tokens see as this sequence's output: a resumed request's included."""
        return self.resumed_ids() + self.output_ids if self.resumed_len else list(self.output_ids)

    def max_prefix_len(self) -> int:
        """At least one token must be computed to produce logits; input logprobs need their span."""
        limit = len(self.fill_ids) - 1
        if self.return_logprob and self.logprob_start_len >= 0:
            # The logprob of token k is computed from position k-1, which must not be cached.
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return max(limit, 0)

    def check_finished(self) -> None:
        if self.finished():
            return
        if self.to_abort is not None:
            self.finished_reason = FinishReason("abort", message=self.to_abort)
            return
        params = self.sampling_params
        last = self.output_ids[-1] if self.output_ids else None
        if last is not None and last in self.stop_ids and self.generated_len >= params.min_new_tokens:
            self.finished_reason = FinishReason("stop", matched=last)
        elif self.grammar is not None and self.grammar.is_terminated():
            self.finished_reason = FinishReason("stop", matched=last)  # the grammar accepted its stop token
        elif len(self.output_ids) >= params.max_new_tokens or self.seqlen >= self.max_context_len:
            self.finished_reason = FinishReason("length")

    def accept_token(self, token_id: int) -> None:
        """Append a sampled token, advancing the grammar; a token the grammar refuses ends the request."""
        self.output_ids.append(token_id)
        if self.grammar is not None and not self.grammar.accept(token_id):
            self.error = RequestError(f"token {token_id} violates the request's {self.grammar.kind} constraint",
                                      "INTERNAL")
            self.to_abort = self.error.message

    def release_grammar(self) -> None:
        if self.grammar is not None:
            self.grammar.release()

    def reset_for_retract(self) -> None:
        self.prefix_indices = _EMPTY
        self.last_node = None
        self.req_pool_idx = None
        self.fill_ids = []
        self.extend_input_len = 0
        self.kv_len = 0
        self.is_chunked = False
        self.is_retracted = True
        self.epoch += 1
        self.pending_future = None

    def __repr__(self) -> str:
        return f"Req(rid={self.rid!r}, index={self.index}, in={len(self.origin_input_ids)}, out={len(self.output_ids)})"


def reqs_from_request(msg: GenerateRequest, eos_ids: set[int], max_context_len: int, share_prompt: bool,
                      grammar: Optional["GrammarBackend"] = None) -> list[Req]:
    """The request's n sequences; with `share_prompt` (a tree cache) siblings wait for the first one's prompt KV.
    A constrained request's sequences each get a RequestGrammar whose compile starts now (on `grammar`'s pool)."""
    params = msg.sampling_params
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids)
    reqs = [Req(msg.rid, i, msg.input_ids, params, stop_ids, msg.return_logprob, msg.top_logprobs_num,
                msg.logprob_start_len, max_context_len, msg.resumed_output_tokens) for i in range(params.n)]
    for req in reqs:
        req.arrival_time = msg.received_at  # not when the scheduler drained its inbox: a burst keeps its spread
        req.trace = msg.trace
        req.lora = msg.lora
        req.session = msg.session
        if share_prompt and msg.lora is None and req is not reqs[0]:
            req.blocked_by = reqs[0]
    if params.constraint is not None and grammar is not None:
        kind, text = params.constraint
        future = grammar.compile(kind, text)
        for req in reqs:
            req.grammar = RequestGrammar(grammar, kind, future)
    return reqs
