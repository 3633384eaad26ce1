"""PrefillScheduler: bootstrap queue → waiting queue (chunked prefill) → inflight queue (KV transfer).

A prefill leg is computed like any prompt, but its KV leaves through NIXL chunk by chunk instead of
staying for decode; once the decode confirms the last WRITE (KVPoll.Success) the prompt goes into the
RadixCache (or is freed) and the leg's stream ends with the first token."""

from __future__ import annotations

import math
import time
from typing import Optional

from common.scheduler.io_struct import FinishReason, GenerateRequest
from common.scheduler.req import Req
from common.scheduler.scheduler import Scheduler
from common.scheduler.schedule_batch import BatchResult
from common.transfer.kv_manager import KVManager, KVSender
from common.transfer.messages import KVPoll, KVTransferMetadata, TransferConfig
from common.transfer.worker_args import layout_of, transfer_error_code, transfer_failure_kind


class PrefillScheduler(Scheduler):
    def __init__(self, engine, transfer_config: TransferConfig):
        super().__init__(engine.config, engine.worker, engine.ops, engine.eos_token_ids, engine.max_context_len,
                         engine._on_outputs)
        # Pages being sent must stay this request's own until the decode has them.
        self.cache_prefill_chunks = False
        self.new_token_ratio = self.ratio_decay = 0.0  # a prefill leg never decodes: reserve nothing
        pool = engine.kv_pool
        self.kv_manager = KVManager("prefill", layout_of(pool), pool.k_buffers, pool.v_buffers, transfer_config)
        self.bootstrap_queue: list[Req] = []  # waiting for the decode to send its destination pages
        self.inflight_queue: list[Req] = []  # prompt computed; waiting for the last WRITE to land
        self.senders: dict[int, KVSender] = {}  # id(req) -> sender
        self.sent_pages: dict[int, int] = {}
        self.transfer_started: dict[int, float] = {}  # id(req) -> time.monotonic() of its first send

    @property
    def bootstrap_port(self) -> int:
        return self.kv_manager.bootstrap_port

    # ---- receive -------------------------------------------------------------------------------

    def handle_generate(self, msg: GenerateRequest) -> None:
        req = self.make_reqs(msg)[0]
        req.room = msg.bootstrap_room
        self.senders[id(req)] = KVSender(self.kv_manager, msg.bootstrap_room, msg.rid)
        self.sent_pages[id(req)] = 0
        self.bootstrap_queue.append(req)

    def abort(self, rid: str, message: str) -> None:
        for req in self.bootstrap_queue + self.inflight_queue:
            if req.rid == rid:
                self.finish_and_release(req, FinishReason("abort", message=message))
        self.bootstrap_queue = [r for r in self.bootstrap_queue if r.rid != rid]
        self.inflight_queue = [r for r in self.inflight_queue if r.rid != rid]
        super().abort(rid, message)  # waiting queue and the request being chunked

    # ---- schedule ------------------------------------------------------------------------------

    def get_next_batch_to_run(self):
        self.poll_bootstrap_queue()
        self.poll_inflight_queue()
        self.drop_failed_waiting()
        return self.get_new_batch_prefill()  # a prefill worker never decodes

    def poll_bootstrap_queue(self) -> None:
        still = []
        for req in self.bootstrap_queue:
            state = self.senders[id(req)].poll()
            if state is KVPoll.Failed:
                self.fail_transfer(req)
            elif state is KVPoll.Bootstrapping:
                still.append(req)
            else:  # the decode reserved its pages: compute the prompt
                req.trace.mark("bootstrap_end")
                if self.metrics is not None:
                    self.metrics.prefill.bootstrap_wait.observe(time.monotonic() - req.arrival_time)
                self.waiting_queue.append(req)
        self.bootstrap_queue = still

    def drop_failed_waiting(self) -> None:
        """A decode that died or aborted while its request waited: do not compute it."""
        failed = [r for r in self.waiting_queue if self.senders[id(r)].poll() is KVPoll.Failed]
        for req in failed:
            self.fail_transfer(req)
        if failed:
            self.waiting_queue = [r for r in self.waiting_queue if r not in failed]

    def poll_inflight_queue(self) -> None:
        still = []
        for req in self.inflight_queue:
            state = self.senders[id(req)].poll()
            if state is KVPoll.Success:
                self.record_transfer(req)
                self.forget(req)
                self.finish_and_release(req, FinishReason("length"))
            elif state is KVPoll.Failed:
                self.fail_transfer(req)
            else:
                still.append(req)
        self.inflight_queue = still

    # ---- process -------------------------------------------------------------------------------

    def on_chunk_computed(self, req: Req, n_tokens: int) -> None:
        super().on_chunk_computed(req, n_tokens)
        if self.metrics is not None:
            self.metrics.prefill.chunks.inc()

    def on_prefill_chunk(self, req: Req, computed_len: int) -> None:
        if id(req) in self.senders:
            self.send_pages(req, computed_len, is_last=False)

    def on_prefill_done(self, req: Req, result: BatchResult, i: int) -> bool:
        if req.to_abort is not None or id(req) not in self.senders:
            self.finish_and_release(req, FinishReason("abort", message=req.to_abort or "aborted"))
            return False
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
            cached_tokens=req.cached_tokens, prompt_tokens=len(req.origin_input_ids))
        self.send_pages(req, len(req.origin_input_ids), is_last=True, metadata=metadata)
        self.inflight_queue.append(req)
        return False  # the leg's output is emitted when the transfer completes

    def send_pages(self, req: Req, computed_len: int, is_last: bool,
                   metadata: Optional[KVTransferMetadata] = None) -> None:
        """Push the pages whose KV is computed; a partly filled last page waits for the next chunk."""
        page_size = self.ops.page_size
        start = self.sent_pages[id(req)]
        end = math.ceil(computed_len / page_size) if is_last else computed_len // page_size
        if end <= start and not is_last:
            return
        row = self.ops.req_to_token_pool.req_to_token[req.req_pool_idx]
        pages = (row[start * page_size: end * page_size: page_size] // page_size).tolist()
        if start == 0:
            req.trace.mark("transfer_start")
            self.transfer_started.setdefault(id(req), time.monotonic())
        self.senders[id(req)].send(pages, is_last, metadata)
        self.sent_pages[id(req)] = end

    def record_transfer(self, req: Req) -> None:
        """The decode holds the whole prompt KV: the leg's transfer span and metrics."""
        pages = self.sent_pages.get(id(req), 0)
        layout = self.kv_manager.layout
        nbytes = layout.transfer_bytes(pages)
        req.trace.transfer(nbytes, pages)
        if self.metrics is not None:
            started = self.transfer_started.get(id(req), time.monotonic())
            self.metrics.transfer.done(nbytes, pages, time.monotonic() - started)

    # ---- endings -------------------------------------------------------------------------------

    def fail_transfer(self, req: Req) -> None:
        reason = self.senders[id(req)].failure_reason() or "KV transfer failed"
        if self.metrics is not None:
            self.metrics.transfer.failed(transfer_failure_kind(reason))
        req.error = (f"KV transfer for room {req.room} failed: {reason}", transfer_error_code(reason))
        self.forget(req)
        self.finish_and_release(req, FinishReason("abort", message=reason))

    def finish_and_release(self, req: Req, reason: FinishReason, emit: bool = True) -> None:
        if reason.kind == "abort":
            sender = self.senders.get(id(req))
            if sender is not None:
                sender.abort(reason.message)  # tell the decode, whatever stage the leg is in
            self.forget(req)
        super().finish_and_release(req, reason, emit)

    def forget(self, req: Req) -> None:
        self.senders.pop(id(req), None)
        self.sent_pages.pop(id(req), None)
        self.transfer_started.pop(id(req), None)

    # ---- loop --------------------------------------------------------------------------------------

    def is_idle(self) -> bool:
        return super().is_idle() and not self.bootstrap_queue and not self.inflight_queue

    def idle_wait(self) -> float:
        if self.bootstrap_queue or self.inflight_queue:
            return 0.0 if not super().is_idle() else 0.002  # only polling transfers: do not spin
        return super().idle_wait()

    def extra_queued_reqs(self) -> list[Req]:
        return self.bootstrap_queue + self.inflight_queue

    def queue_sizes(self) -> dict:
        return {**super().queue_sizes(), "bootstrap": len(self.bootstrap_queue),
                "inflight": len(self.inflight_queue)}

    def close(self) -> None:
        self.kv_manager.close()
