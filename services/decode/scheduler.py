"""DecodeScheduler: the decode worker's event loops (SGLang's disaggregated decode loop, seed 003).

    recv → process input (prealloc queue, or waiting queue) → pop preallocated (reserve pages, tell the prefill
         where to WRITE) → pop transferred (prebuilt entries join the running batch) → get batch → run → process

A decode leg reserves KV pages for its prompt (admission control keeps room for the requests already decoding),
tells the prefill where to WRITE, and once NIXL reports the last WRITE it joins the running batch with the
prefill's first token — no forward pass. Each request's transfer is its KVReceiver, hung on `req.transfer`.

A plain request (no bootstrap room: the router chose not to use a prefill worker) is prefilled here, as a unified
worker would: it joins the ordinary waiting queue, chunked under the same prefill budget, its prompt cached in the
same RadixCache. Retracted legs are re-prefilled locally through that queue too.
"""

from __future__ import annotations

import time

from tandem.common.model.forward_batch import ForwardMode
from tandem.common.scheduler.base import RoleQueue, SchedulerBase
from tandem.common.scheduler.batcher import TokenRatio
from tandem.common.scheduler.io_struct import (RESUMED_OUTPUT_TOKENS_KEY, AbortRequest, FinishReason,
                                               GenerateRequest, RequestError)
from tandem.common.scheduler.loop import ControlCall, Inbox
from tandem.common.scheduler.model_worker import InFlight
from tandem.common.scheduler.parts import SchedulerParts
from tandem.common.scheduler.prefill_adder import reserved_decode_tokens
from tandem.common.scheduler.req import Req, reqs_from_request
from tandem.common.scheduler.schedule_batch import ScheduleBatch
from tandem.common.telemetry.metrics import DecodeMetrics
from tandem.common.telemetry.tracing import ATTR_CACHED_TOKENS
from tandem.common.transfer.failures import FailureKind, TransferFailure
from tandem.common.transfer.kv_manager import DecodeKVManager, KVReceiver
from tandem.common.transfer.messages import KVPoll, KVTransferMetadata

# After a failed or aborted transfer the prefill may still have WRITEs in flight into our pages:
# hold them this long before they can be handed to another request.
QUARANTINE_S = 2.0


class DecodeScheduler(SchedulerBase):
    def __init__(self, parts: SchedulerParts, kv_manager: DecodeKVManager):
        super().__init__(parts, TokenRatio.of(parts.config), embeds=False)
        self.kv_manager = kv_manager
        self.metrics = DecodeMetrics(parts.metrics.registry)
        self.prealloc_queue: list[Req] = []  # waiting for KV pages
        self.transfer_queue: list[Req] = []  # pages reserved; the prefill is writing them
        self.quarantine: list[tuple[float, Req]] = []  # (until, leg) of failed transfers, pages held

    # ---- event loops -----------------------------------------------------------------------------

    def event_loop_normal(self) -> None:
        while not self.stopped:
            self.process_input_requests(self.inbox.recv(self.idle_wait()))
            self.pop_grammar_ready()
            self.release_quarantine()
            self.pop_preallocated()
            self.pop_transferred()
            batch = self.cur_batch = self.batcher.get_next_batch_to_run(self.last_batch)  # retracted legs re-prefill
            if batch is not None:
                result = self.runner.run(batch)
                self.outputs.process_batch_result(batch, result)
            self.last_batch = batch

    def event_loop_overlap(self) -> None:
        in_flight = InFlight(self.runner)
        while not self.stopped:
            self.process_input_requests(self.inbox.recv(0.0 if in_flight else self.idle_wait()))
            self.pop_grammar_ready()
            self.release_quarantine()
            self.pop_preallocated()
            self.pop_transferred()
            batch = self.cur_batch = self.batcher.get_next_batch_to_run(self.last_batch)
            if batch is not None:
                in_flight.launch(batch)
            if (previous := in_flight.pop_previous(launched_now=batch is not None)) is not None:
                self.outputs.process_batch_result(*previous)
            in_flight.fill_grammar_mask()  # after the previous step's tokens advanced the matchers
            self.last_batch = batch
        for previous in in_flight.drain():
            self.outputs.process_batch_result(*previous)

    # ---- receive -------------------------------------------------------------------------------

    def process_input_requests(self, msgs: list) -> None:
        for msg in msgs:
            if isinstance(msg, GenerateRequest) and msg.bootstrap_room is None:
                self.metrics.local_prefill.inc()
                reqs = self.ops.prefetch(self.make_local_reqs(msg))
                self.batcher.waiting_queue.extend(self.grammar_queue.admit(reqs))
            elif isinstance(msg, GenerateRequest):
                self.prealloc_queue.extend(self.grammar_queue.admit([self.make_leg(msg)]))
            elif isinstance(msg, AbortRequest):
                self.abort(msg.rid, msg.message)
            elif isinstance(msg, ControlCall):
                msg.run(self)
            elif msg is Inbox.STOP:
                self.stopped = True

    def make_leg(self, msg: GenerateRequest) -> Req:
        req = reqs_from_request(msg, self.parts.eos_token_ids, self.parts.max_context_len, share_prompt=False,
                                grammar=self.parts.grammar)[0]
        req.room = msg.bootstrap_room
        req.logprob_start_len = -1  # prompt logprobs come from the prefill leg; this leg never computes them
        req.transfer = KVReceiver(self.kv_manager, msg.bootstrap_room, msg.bootstrap_host, msg.bootstrap_port)
        return req

    def make_local_reqs(self, msg: GenerateRequest) -> list[Req]:
        """A request this worker prefills itself: its n sequences, as the unified scheduler makes them."""
        return reqs_from_request(msg, self.parts.eos_token_ids, self.parts.max_context_len, self.ops.caching,
                                 self.parts.grammar)

    def abort(self, rid: str, message: str) -> None:
        self.grammar_queue.abort(rid, message)
        for req in [r for r in self.prealloc_queue + self.transfer_queue if r.rid == rid]:
            self.prealloc_queue = [r for r in self.prealloc_queue if r is not req]
            self.transfer_queue = [r for r in self.transfer_queue if r is not req]
            self.quarantine_leg(req, message)  # aborts its transfer
        self.batcher.abort(rid, message, self.live_reqs())

    # ---- the transfer queues -----------------------------------------------------------------------

    def pop_grammar_ready(self) -> None:
        """Legs whose constraint compiled go on to the prealloc queue, local requests to the waiting queue; an
        invalid one ends (INVALID_ARGUMENT)."""
        for req in self.grammar_queue.pop_ready():
            (self.batcher.waiting_queue if req.transfer is None else self.prealloc_queue).append(req)

    def pop_preallocated(self) -> None:
        """First come, first served: reserve pages for the head of the prealloc queue while they fit. A leg whose
        transfer failed ends wherever it waits, not once the legs ahead of it got pages."""
        failed = [r for r in self.prealloc_queue if r.transfer.poll() is KVPoll.Failed]
        if failed:
            self.prealloc_queue = [r for r in self.prealloc_queue if all(r is not f for f in failed)]
            for req in failed:
                self.fail_transfer(req)
        while self.prealloc_queue:
            req = self.prealloc_queue[0]
            if req.transfer.poll() is KVPoll.Failed:
                self.prealloc_queue.pop(0)
                self.fail_transfer(req)
                continue
            if not self.preallocate(req):
                return  # later legs wait behind this one
            self.prealloc_queue.pop(0)
            self.transfer_queue.append(req)

    def admissible(self, req: Req) -> bool:
        """Room for this prompt plus the tokens already-admitted requests are still expected to need. Retracted
        requests (the waiting queue) go first: a new leg taking the pages they wait for could starve them."""
        active = self.batcher.running_batch.reqs + self.transfer_queue
        if (len(active) >= self.config.max_running_requests or self.ops.req_to_token_pool.available_size() < 1
                or self.batcher.waiting_queue):
            return False
        ratio = self.batcher.new_token_ratio
        reserved = sum(reserved_decode_tokens(r, ratio) for r in active if not r.finished())
        need = len(req.origin_input_ids) + self.ops.page_size + reserved_decode_tokens(req, ratio)
        return self.ops.available_tokens() - reserved >= need

    def preallocate(self, req: Req) -> bool:
        if not self.admissible(req):
            return False
        self.ops.match_prefix(req)  # the decode-side prefix cache: those pages need no transfer
        prompt_len, prefix_len = len(req.origin_input_ids), len(req.prefix_indices)
        self.ops.lock(req)
        if ScheduleBatch([req], ForwardMode.EXTEND).alloc_extend(self.ops) is None:  # pages only, no forward inputs
            self.ops.unlock(req)
            return False
        self.ops.record_admission(req)
        page_size = self.ops.page_size
        row = self.ops.req_to_token_pool.req_to_token[req.req_pool_idx]
        dst_pages = (row[0:prompt_len:page_size] // page_size).tolist()
        req.transfer.init(dst_pages, prefix_tokens=prefix_len, request_id=req.rid)
        req.trace.mark("prealloc_end")
        req.trace.mark("transfer_start")
        self.metrics.prealloc_wait.observe(time.monotonic() - req.arrival_time)
        return True

    def pop_transferred(self) -> None:
        """Legs whose prompt KV arrived join the running batch; failed transfers end the leg."""
        still, arrived = [], []
        for req in self.transfer_queue:
            state = req.transfer.poll()
            if state is KVPoll.Success:
                arrived.append(req)
            elif state is KVPoll.Failed:
                self.fail_transfer(req)
            else:
                still.append(req)
        self.transfer_queue = still
        for req in arrived:
            self.add_prebuilt(req, req.transfer.metadata())

    def add_prebuilt(self, req: Req, metadata: KVTransferMetadata) -> None:
        """The prompt's KV is here: join the running batch with the prefill's first token."""
        if metadata.room != req.room:
            failure = TransferFailure(FailureKind.ROOM_MISMATCH, f"KV transfer integrity check failed: metadata for "
                                      f"room {metadata.room}, expected {req.room}")
            self.end_failed_leg(req, failure)
            return
        self.record_transfer(req)
        req.transfer = None
        req.prefill_done = True
        if metadata.resumed_output_tokens != req.resumed_len:
            self.end_mismatched_resume(req, metadata.resumed_output_tokens)
            return
        req.cached_tokens = metadata.cached_tokens  # what the prefill skipped computing (usage semantics)
        self.outputs.counters.prompt_tokens += len(req.origin_input_ids)
        top = list(metadata.top_logprobs)[: req.top_logprobs_num]
        self.outputs.append_token(req, metadata.first_token_id, metadata.first_token_logprob, top)
        if req.finished():
            self.outputs.finish(req, req.finished_reason)
            return
        self.ops.cache_unfinished(req)
        self.batcher.running_batch.merge(ScheduleBatch([req], ForwardMode.DECODE))
        self.outputs.emit([req])

    def end_mismatched_resume(self, req: Req, prefill_resumed: int) -> None:
        """The legs disagree on how much of the prompt is output: the first token was sampled for another grammar
        and penalty state than this leg would continue from."""
        key = RESUMED_OUTPUT_TOKENS_KEY
        message = (f"{key}: the prefill leg resumed {prefill_resumed} output tokens, this decode leg "
                   f"{req.resumed_len}; send the same metadata on both legs")
        req.error = RequestError(message, "INVALID_ARGUMENT")
        self.outputs.finish(req, FinishReason("abort", message=message))

    def record_transfer(self, req: Req) -> None:
        """The whole prompt KV arrived: the leg's transfer span and metrics."""
        receiver: KVReceiver = req.transfer
        req.trace.transfer(receiver.bytes_expected, receiver.pages_expected)
        req.trace.set(ATTR_CACHED_TOKENS, req.cached_tokens)
        self.metrics.transfer.done(receiver.bytes_expected, receiver.pages_expected,
                                   time.monotonic() - receiver.started_at)
        self.metrics.prebuilt.inc()

    # ---- endings -------------------------------------------------------------------------------

    def fail_transfer(self, req: Req) -> None:
        self.end_failed_leg(req, req.transfer.failure)

    def end_failed_leg(self, req: Req, failure: TransferFailure) -> None:
        self.metrics.transfer.failed(failure.policy.metric_label)
        req.error = RequestError.of_transfer(req.room, failure)
        req.transfer = None  # failed already (or its metadata did not match): nothing to abort
        self.quarantine_leg(req, failure.message)

    def quarantine_leg(self, req: Req, message: str) -> None:
        """End the leg now (aborting a transfer still open); free its pages only after late WRITEs can no longer
        land in them."""
        self.outputs.end(req, FinishReason("abort", message=message))
        self.outputs.emit([req])
        if req.req_pool_idx is not None:
            self.quarantine.append((time.monotonic() + QUARANTINE_S, req))

    def release_quarantine(self) -> None:
        now = time.monotonic()
        due = [req for until, req in self.quarantine if until <= now]
        self.quarantine = [(until, req) for until, req in self.quarantine if until > now]
        for req in due:
            self.ops.release(req)

    # ---- state ---------------------------------------------------------------------------------

    def role_queues(self) -> list[RoleQueue]:
        """A leg waits for its pages, and runs once they are reserved (its KV in flight); quarantined legs have
        ended and count in neither."""
        return [RoleQueue("prealloc", self.prealloc_queue, "waiting"),
                RoleQueue("transfer", self.transfer_queue, "running"),
                RoleQueue("quarantine", self.quarantine, "")]

    def close(self) -> None:
        self.kv_manager.close()
