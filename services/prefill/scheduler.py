"""PrefillScheduler: the prefill worker's event loops (SGLang's disaggregated prefill loop, seed 003).

    recv → process input (bootstrap queue) → pop bootstrapped (→ waiting queue) → get new prefill batch → run
         → process result (send each finished chunk's KV; the first token goes with the last) → poll inflight queue

A prefill leg is computed like any prompt, but its KV leaves through NIXL chunk by chunk instead of staying for
decode; once the decode confirms the last WRITE (KVPoll.Success) the prompt goes into the RadixCache (or is freed)
and the leg's stream ends with the first token. Each request's transfer is its KVSender, hung on `req.transfer`.
"""

from __future__ import annotations

import math
import time
from typing import Optional

from tandem.common.scheduler.base import RoleQueue, SchedulerBase
from tandem.common.scheduler.batcher import TokenRatio
from tandem.common.scheduler.io_struct import AbortRequest, EmbedRequest, FinishReason, GenerateRequest, RequestError
from tandem.common.scheduler.loop import ControlCall, Inbox
from tandem.common.scheduler.model_worker import InFlight
from tandem.common.scheduler.parts import SchedulerParts
from tandem.common.scheduler.req import Req, reqs_from_request
from tandem.common.scheduler.schedule_batch import BatchResult, ScheduleBatch
from tandem.common.telemetry.metrics import PrefillMetrics
from tandem.common.transfer.kv_manager import KVSender, PrefillKVManager
from tandem.common.transfer.messages import KVPoll, KVTransferMetadata


class PrefillScheduler(SchedulerBase):
    def __init__(self, parts: SchedulerParts, kv_manager: PrefillKVManager):
        # A prefill leg never decodes here: admission reserves no decode tokens.
        super().__init__(parts, TokenRatio.none(), pins_sessions=False)
        self.kv_manager = kv_manager
        self.metrics = PrefillMetrics(parts.metrics.registry)
        self.bootstrap_queue: list[Req] = []  # waiting for the decode to send its destination pages
        self.inflight_queue: list[Req] = []  # prompt computed; waiting for the last WRITE to land

    # ---- event loops -----------------------------------------------------------------------------

    def event_loop_normal(self) -> None:
        while not self.stopped:
            self.process_input_requests(self.inbox.recv(self.idle_wait()))
            self.pop_grammar_ready()
            self.embedder.run_batch()
            self.pop_bootstrapped()
            batch = self.cur_batch = self.batcher.get_new_batch_prefill()
            if batch is not None:
                result = self.runner.run(batch)
                self.process_batch_result(batch, result)
            self.process_inflight_queue()
            self.last_batch = batch

    def event_loop_overlap(self) -> None:
        in_flight = InFlight(self.runner)
        while not self.stopped:
            self.process_input_requests(self.inbox.recv(0.0 if in_flight else self.idle_wait()))
            self.pop_grammar_ready()
            self.embedder.run_batch()
            self.pop_bootstrapped()
            batch = self.cur_batch = self.batcher.get_new_batch_prefill()
            if batch is not None:
                in_flight.launch(batch)
            if (previous := in_flight.pop_previous(launched_now=batch is not None)) is not None:
                self.process_batch_result(*previous)
            in_flight.fill_grammar_mask()  # after the previous step's tokens advanced the matchers
            self.process_inflight_queue()
            self.last_batch = batch
        for previous in in_flight.drain():
            self.process_batch_result(*previous)

    # ---- receive -------------------------------------------------------------------------------

    def process_input_requests(self, msgs: list) -> None:
        for msg in msgs:
            if isinstance(msg, GenerateRequest):
                self.bootstrap_queue.extend(self.grammar_queue.admit(self.ops.prefetch([self.make_leg(msg)])))
            elif isinstance(msg, EmbedRequest):
                self.embedder.add(msg)
            elif isinstance(msg, AbortRequest):
                self.embedder.abort(msg.rid)
                self.abort(msg.rid, msg.message)
            elif isinstance(msg, ControlCall):
                msg.run(self)
            elif msg is Inbox.STOP:
                self.stopped = True

    def make_leg(self, msg: GenerateRequest) -> Req:
        req = reqs_from_request(msg, self.parts.eos_token_ids, self.parts.max_context_len, share_prompt=False,
                                grammar=self.parts.grammar)[0]
        req.room = msg.bootstrap_room
        req.transfer = KVSender(self.kv_manager, msg.bootstrap_room, msg.rid)
        return req

    def abort(self, rid: str, message: str) -> None:
        self.grammar_queue.abort(rid, message)
        for req in [r for r in self.bootstrap_queue + self.inflight_queue if r.rid == rid]:
            self.outputs.finish(req, FinishReason("abort", message=message))  # aborts its transfer too
        self.bootstrap_queue = [r for r in self.bootstrap_queue if r.rid != rid]
        self.inflight_queue = [r for r in self.inflight_queue if r.rid != rid]
        self.batcher.abort(rid, message, self.live_reqs())

    # ---- schedule ------------------------------------------------------------------------------

    def pop_grammar_ready(self) -> None:
        """Legs whose constraint compiled go on to the bootstrap queue; an invalid one ends (INVALID_ARGUMENT)."""
        self.bootstrap_queue.extend(self.grammar_queue.pop_ready())

    def pop_bootstrapped(self) -> None:
        """Legs whose decode reserved its pages join the waiting queue; legs whose transfer failed meanwhile
        (in either queue: the decode died or aborted) end without being computed."""
        still = []
        for req in self.bootstrap_queue:
            state = req.transfer.poll()
            if state is KVPoll.Failed:
                self.fail_transfer(req)
            elif state is KVPoll.Bootstrapping:
                still.append(req)
            else:
                req.trace.mark("bootstrap_end")
                self.metrics.bootstrap_wait.observe(time.monotonic() - req.arrival_time)
                self.batcher.waiting_queue.append(req)
        self.bootstrap_queue = still
        failed = [r for r in self.batcher.waiting_queue if r.transfer.poll() is KVPoll.Failed]
        for req in failed:
            self.fail_transfer(req)
        if failed:
            self.batcher.waiting_queue = [r for r in self.batcher.waiting_queue if r not in failed]

    # ---- process -------------------------------------------------------------------------------

    def process_batch_result(self, batch: ScheduleBatch, result: BatchResult) -> None:
        """Send each computed chunk's full pages; a finished prompt sends the rest with its first token.
        (Unlike a unified worker's, chunks are not published to the tree cache: pages being sent must stay this
        request's own until the decode has them.)"""
        for i, req, chunked in self.outputs.current_rows(batch):
            self.outputs.record_extend(req, result, batch.work, i)
            self.metrics.chunks.inc()
            if chunked:
                # In the overlap loop the request may already be scheduled further: its own kv_len runs ahead
                # of what is computed, so the batch's sequence length says what exists.
                self.send_kv_chunk(req, batch.work.forward_batch.seq_lens_cpu[i], is_last=False)
                continue
            self.outputs.prompt_done(req)
            if req.to_abort is not None:
                self.outputs.finish(req, FinishReason("abort", message=req.to_abort))
                continue
            self.send_last_chunk(req, result, i)
            self.inflight_queue.append(req)

    def send_last_chunk(self, req: Req, result: BatchResult, i: int) -> None:
        """The rest of the prompt's pages, and the metadata the decode continues from: the first token."""
        token = result.next_token_ids[i]
        req.output_ids.append(token)
        logprob = result.logprobs[i] if result.logprobs is not None else 0.0
        top = result.top_logprobs[i] if result.top_logprobs is not None and req.top_logprobs_num else []
        if req.return_logprob and result.logprobs is not None:
            req.output_logprobs.append(logprob)
            if top:
                req.output_top_logprobs.append(top)
        metadata = KVTransferMetadata(
            room=req.room, first_token_id=token, first_token_logprob=logprob, top_logprobs=list(top),
            cached_tokens=req.cached_tokens, prompt_tokens=len(req.origin_input_ids),
            resumed_output_tokens=req.resumed_len)
        self.send_kv_chunk(req, len(req.origin_input_ids), is_last=True, metadata=metadata)

    def send_kv_chunk(self, req: Req, computed_len: int, is_last: bool,
                      metadata: Optional[KVTransferMetadata] = None) -> None:
        """Push the pages whose KV is computed; a partly filled last page waits for the next chunk."""
        sender: KVSender = req.transfer
        page_size = self.ops.page_size
        start = sender.pages_sent
        end = math.ceil(computed_len / page_size) if is_last else computed_len // page_size
        if end <= start and not is_last:
            return
        row = self.ops.req_to_token_pool.req_to_token[req.req_pool_idx]
        pages = (row[start * page_size: end * page_size: page_size] // page_size).tolist()
        if start == 0:
            req.trace.mark("transfer_start")
        sender.send(pages, is_last, metadata)

    def process_inflight_queue(self) -> None:
        """Legs whose last WRITE landed end (the prompt stays in the tree cache); failed ones end with the failure."""
        still = []
        for req in self.inflight_queue:
            state = req.transfer.poll()
            if state is KVPoll.Success:
                self.record_transfer(req)
                req.transfer = None
                self.outputs.finish(req, FinishReason("length"))
            elif state is KVPoll.Failed:
                self.fail_transfer(req)
            else:
                still.append(req)
        self.inflight_queue = still

    def record_transfer(self, req: Req) -> None:
        """The decode holds the whole prompt KV: the leg's transfer span and metrics."""
        sender: KVSender = req.transfer
        req.trace.transfer(sender.bytes_sent, sender.pages_sent)
        self.metrics.transfer.done(sender.bytes_sent, sender.pages_sent, time.monotonic() - sender.started_at)

    def fail_transfer(self, req: Req) -> None:
        failure = req.transfer.failure
        self.metrics.transfer.failed(failure.policy.metric_label)
        req.error = RequestError.of_transfer(req.room, failure)
        req.transfer = None  # already failed: nothing to abort
        self.outputs.finish(req, FinishReason("abort", message=failure.message))

    # ---- state ---------------------------------------------------------------------------------

    def role_queues(self) -> list[RoleQueue]:
        """A leg waits for its decode's pages, and runs once it is scheduled until its KV has landed."""
        return [RoleQueue("bootstrap", self.bootstrap_queue, "waiting"),
                RoleQueue("inflight", self.inflight_queue, "running")]

    def close(self) -> None:
        self.kv_manager.close()
