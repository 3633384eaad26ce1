"""Step results into request progress (OutputProcessor) and progress into the TokenOutputs streamed to callers
(OutputBuilder)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from tandem.common.model.forward_batch import ForwardMode
from tandem.common.scheduler.io_struct import FinishReason, RequestError, TokenOutput
from tandem.common.scheduler.kv_cache_ops import KVCacheOps
from tandem.common.scheduler.req import Req
from tandem.common.scheduler.schedule_batch import BatchResult, ModelWorkBatch, ScheduleBatch
from tandem.common.scheduler.sessions import SessionPins

OutputSink = Callable[[list[TokenOutput]], None]


class OutputBuilder:
    def add_input_logprobs(self, req: Req, result: BatchResult, work: ModelWorkBatch, i: int) -> None:
        """Record prompt-token logprobs (and their top-k) computed by one extend (positions prefix+1 onwards)."""
        values = result.input_logprobs[i]
        if values is None:
            return
        tops = result.input_top_logprobs[i] if result.input_top_logprobs else None
        prefix = work.forward_batch.extend_prefix_lens_cpu[i]
        prompt_len = len(req.origin_input_ids)
        for offset, value in enumerate(values):
            position = prefix + 1 + offset
            if position < prompt_len:
                req.input_logprobs.setdefault(position, value)
                if tops is not None:
                    req.input_top_logprobs.setdefault(position, tops[offset])

    def _input_logprob_lists(self, req: Req) -> tuple[Optional[list[Optional[float]]],
                                                       Optional[list[list[tuple[int, float]]]]]:
        """(each prompt token's logprob, its top-k: [] for the first token) once per request."""
        if not (req.return_logprob and req.logprob_start_len >= 0) or req.input_logprobs_sent:
            return None, None
        req.input_logprobs_sent = True
        positions = range(min(req.logprob_start_len, len(req.origin_input_ids)), len(req.origin_input_ids))
        values = [None if pos == 0 else req.input_logprobs.get(pos) for pos in positions]
        tops = [req.input_top_logprobs.get(pos, []) for pos in positions] if req.top_logprobs_num > 0 else None
        return values, tops

    def build(self, req: Req) -> Optional[TokenOutput]:
        new_ids = req.output_ids[req.sent_len:]
        if not new_ids and not req.finished():
            return None
        start = req.sent_len
        req.sent_len = len(req.output_ids)
        out = TokenOutput(
            rid=req.rid, index=req.index, token_ids=new_ids,
            finished=req.finished(), finish_reason=req.finished_reason,
            prompt_tokens=len(req.origin_input_ids), completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
        )
        out.error = req.error
        if req.return_logprob:
            out.logprobs = req.output_logprobs[start:]
            if req.top_logprobs_num > 0:
                out.top_logprobs = req.output_top_logprobs[start:]
            if req.prefill_done or req.finished():
                out.input_logprobs, out.input_top_logprobs = self._input_logprob_lists(req)
        return out


@dataclass
class SchedulerCounters:
    num_retractions: int = 0
    num_aborts: int = 0
    num_finished: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0


class OutputProcessor:
    """Applies a step's result to its requests: records prompt logprobs, appends sampled tokens, ends requests
    (caching or freeing their KV, aborting their transfer) and streams what is new to the sink."""

    def __init__(self, ops: KVCacheOps, sink: OutputSink, sessions: Optional[SessionPins] = None):
        self.ops = ops
        self.sessions = sessions  # pins a finished session turn's KV (None: this role pins nothing)
        self.sink = sink
        self.builder = OutputBuilder()
        self.counters = SchedulerCounters()

    # ---- reading a result ----------------------------------------------------------------------

    def current_rows(self, batch: ScheduleBatch) -> Iterator[tuple[int, Req, bool]]:
        """(row, request, is an intermediate chunk) for the rows whose request still runs the attempt this
        batch computed: not retracted since (epoch), not ended while the batch was in flight."""
        futures = batch.work.future_indices
        future_ids = futures.tolist() if futures is not None else None  # once, not a tensor read per request
        for i, (req, epoch, chunked) in enumerate(zip(batch.reqs, batch.epochs, batch.chunked)):
            if req.epoch != epoch:
                continue
            if future_ids is not None and req.pending_future == future_ids[i]:
                req.pending_future = None
            if not req.finished():
                yield i, req, chunked

    def record_extend(self, req: Req, result: BatchResult, work: ModelWorkBatch, i: int) -> None:
        """One extend of the prompt (a chunk, or all of it) was computed for row i."""
        self.builder.add_input_logprobs(req, result, work, i)
        req.trace.chunk(work.forward_batch.extend_seq_lens_cpu[i])

    def prompt_done(self, req: Req) -> None:
        req.prefill_done = True
        req.trace.mark("forward_end")
        self.counters.prompt_tokens += len(req.origin_input_ids)

    def append_token(self, req: Req, token_id: int, logprob: Optional[float] = None,
                     top_logprobs: Optional[list] = None) -> None:
        req.accept_token(token_id)
        if req.return_logprob and logprob is not None:
            req.output_logprobs.append(logprob)
            if top_logprobs is not None and req.top_logprobs_num > 0:
                req.output_top_logprobs.append(top_logprobs)
        self.counters.generation_tokens += 1
        req.check_finished()

    def append_sampled(self, req: Req, result: BatchResult, i: int) -> None:
        """Row i's sampled token (and its logprobs when asked)."""
        logprob = result.logprobs[i] if result.logprobs is not None else None
        top = result.top_logprobs[i] if result.top_logprobs is not None else None
        self.append_token(req, result.next_token_ids[i], logprob, top)

    # ---- the results of a scheduler that decodes what it prefills ------------------------------------

    def process_batch_result(self, batch: ScheduleBatch, result: BatchResult) -> None:
        if batch.mode is ForwardMode.EXTEND:
            self.process_prefill_result(batch, result)
        else:
            self.process_decode_result(batch, result)

    def process_prefill_result(self, batch: ScheduleBatch, result: BatchResult) -> None:
        """An extend batch: finished prompts get their first token and keep their KV for decoding; the running
        requests' decode rows mixed into it (--enable-mixed-chunk) get their next token."""
        touched = []
        for i, req, chunked in self.current_rows(batch):
            if not batch.is_prefill_row(i):
                self.decoded(req, result, i, touched)
                continue
            self.record_extend(req, result, batch.work, i)
            if chunked:
                continue
            self.prompt_done(req)
            touched.append(req)
            if req.sampling_params.max_new_tokens == 0:
                self.finish(req, FinishReason("length"), emit=False)
                continue
            self.append_sampled(req, result, i)
            if req.finished():
                self.finish(req, req.finished_reason, emit=False)
            else:
                self.ops.cache_unfinished(req)
        self.emit(touched)

    def process_decode_result(self, batch: ScheduleBatch, result: BatchResult) -> None:
        """A decode batch: one new token per request."""
        touched = []
        for i, req, _ in self.current_rows(batch):
            self.decoded(req, result, i, touched)
        self.emit(touched)

    def decoded(self, req: Req, result: BatchResult, i: int, touched: list[Req]) -> None:
        """Row i was a decode step of a running request."""
        self.append_sampled(req, result, i)
        touched.append(req)
        if req.finished():
            self.finish(req, req.finished_reason, emit=False)

    # ---- endings -------------------------------------------------------------------------------

    def finish(self, req: Req, reason: FinishReason, emit: bool = True) -> None:
        """End the request: an abort drops its KV (and aborts its transfer), a finish keeps it in the tree cache."""
        self.end(req, reason)
        if reason.kind == "abort":
            self.ops.release(req)
        else:
            self.ops.cache_finished(req)
            if self.sessions is not None:
                self.sessions.pin(req)
        if emit:
            self.emit([req])

    def end(self, req: Req, reason: FinishReason) -> None:
        """`finish` without the KV: the caller caches or frees the pages (a decode leg's quarantine frees them
        only once late WRITEs can no longer land)."""
        req.finished_reason = reason
        req.release_grammar()
        if reason.kind == "abort":
            self.counters.num_aborts += 1
            if req.transfer is not None:
                req.transfer.abort(reason.message)  # tells the other leg, whatever stage the transfer is in
                req.transfer = None
        else:
            self.counters.num_finished += 1

    def fail(self, reqs: list[Req], message: str) -> None:
        """The scheduler crashed: every unfinished request gets an INTERNAL error."""
        failed = [r for r in reqs if not r.finished()]
        for req in failed:
            req.release_grammar()
            req.error = RequestError(message, "INTERNAL")
            req.finished_reason = FinishReason("abort", message=message)
        self.emit(failed)

    def emit(self, reqs: list[Req]) -> None:
        outs = [o for o in (self.builder.build(r) for r in reqs) if o is not None]
        if outs:
            self.sink(outs)
