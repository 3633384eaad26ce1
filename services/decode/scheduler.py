"""DecodeScheduler: prealloc queue → transfer queue → prebuilt entry in the running decode batch.

A decode leg reserves KV pages for its prompt (admission control keeps room for the requests already
decoding), tells the prefill where to WRITE, and once NIXL reports the last WRITE it joins the
running batch with the prefill's first token — no forward pass. Retracted requests are re-prefilled
locally through the ordinary waiting queue."""

from __future__ import annotations

import time

from common.scheduler.io_struct import FinishReason, GenerateRequest
from common.scheduler.prefill_adder import reserved_decode_tokens
from common.scheduler.req import Req
from common.scheduler.scheduler import Scheduler
from common.scheduler.schedule_batch import ScheduleBatch
from common.model.forward_batch import ForwardMode
from common.telemetry.tracing import ATTR_CACHED_TOKENS
from common.transfer.kv_manager import KVManager, KVReceiver
from common.transfer.messages import KVPoll, TransferConfig
from common.transfer.worker_args import layout_of, transfer_error_code, transfer_failure_kind

# After a failed or aborted transfer the prefill may still have WRITEs in flight into our pages:
# hold them this long before they can be handed to another request.
QUARANTINE_S = 2.0


class DecodeScheduler(Scheduler):
    def __init__(self, engine, transfer_config: TransferConfig):
        super().__init__(engine.config, engine.worker, engine.ops, engine.eos_token_ids, engine.max_context_len,
                         engine._on_outputs)
        pool = engine.kv_pool
        self.kv_manager = KVManager("decode", layout_of(pool), pool.k_buffers, pool.v_buffers, transfer_config)
        self.prealloc_queue: list[Req] = []  # waiting for KV pages
        self.transfer_queue: list[Req] = []  # pages reserved; the prefill is writing them
        self.quarantine: list[tuple[float, Req]] = []
        self.receivers: dict[int, KVReceiver] = {}
        self.transfer_started: dict[int, tuple[float, int]] = {}  # id(req) -> (time.monotonic(), pages to write)

    # ---- receive -------------------------------------------------------------------------------

    def handle_generate(self, msg: GenerateRequest) -> None:
        req = self.make_reqs(msg)[0]
        req.room = msg.bootstrap_room
        req.logprob_start_len = -1  # prompt logprobs come from the prefill leg; this leg never computes them
        self.receivers[id(req)] = KVReceiver(self.kv_manager, msg.bootstrap_room, msg.bootstrap_host,
                                             msg.bootstrap_port)
        self.prealloc_queue.append(req)

    def abort(self, rid: str, message: str) -> None:
        for req in [r for r in self.prealloc_queue + self.transfer_queue if r.rid == rid]:
            self.fail_leg(req, message)
        super().abort(rid, message)

    # ---- schedule ------------------------------------------------------------------------------

    def get_next_batch_to_run(self):
        self.release_quarantine()
        self.poll_prealloc_queue()
        self.poll_transfer_queue()
        return super().get_next_batch_to_run()

    def poll_prealloc_queue(self) -> None:
        while self.prealloc_queue:
            req = self.prealloc_queue[0]
            if self.receivers[id(req)].poll() is KVPoll.Failed:
                self.prealloc_queue.pop(0)
                self.fail_transfer(req)
                continue
            if not self.preallocate(req):
                return  # first come, first served: later legs wait behind this one
            self.prealloc_queue.pop(0)
            self.transfer_queue.append(req)

    def admissible(self, req: Req) -> bool:
        """Room for this prompt plus the tokens already-admitted requests are still expected to need."""
        active = self.running_batch.reqs + self.transfer_queue
        if len(active) >= self.config.max_running_requests or self.ops.req_to_token_pool.available_size() < 1:
            return False
        reserved = sum(reserved_decode_tokens(r, self.new_token_ratio) for r in active if not r.finished())
        need = len(req.origin_input_ids) + self.ops.page_size + reserved_decode_tokens(req, self.new_token_ratio)
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
        self.receivers[id(req)].init(dst_pages, prefix_tokens=prefix_len, request_id=req.rid)
        self.record_prealloc(req, len(dst_pages) - prefix_len // page_size)
        return True

    def record_prealloc(self, req: Req, pages_to_write: int) -> None:
        req.trace.mark("prealloc_end")
        req.trace.mark("transfer_start")
        self.transfer_started[id(req)] = (time.monotonic(), pages_to_write)
        if self.metrics is not None:
            self.metrics.decode.prealloc_wait.observe(time.monotonic() - req.arrival_time)

    def poll_transfer_queue(self) -> None:
        still, arrived = [], []
        for req in self.transfer_queue:
            receiver = self.receivers[id(req)]
            state = receiver.poll()
            if state is KVPoll.Success:
                arrived.append((req, receiver.metadata()))
            elif state is KVPoll.Failed:
                self.fail_transfer(req)
            else:
                still.append(req)
        self.transfer_queue = still
        for req, metadata in arrived:
            self.receivers.pop(id(req), None)
            self.add_prebuilt(req, metadata)

    def add_prebuilt(self, req: Req, metadata) -> None:
        """The prompt's KV is here: join the running batch with the prefill's first token."""
        if metadata.room != req.room:
            req.error = (f"KV transfer integrity check failed: metadata for room {metadata.room}, "
                         f"expected {req.room}", "DATA_LOSS")
            self.transfer_started.pop(id(req), None)
            if self.metrics is not None:
                self.metrics.transfer.failed("integrity")
            self.quarantine_leg(req, "room mismatch")
            return
        req.prefill_done = True
        req.cached_tokens = metadata.cached_tokens  # what the prefill skipped computing (usage semantics)
        self.record_transfer(req)
        req.output_ids.append(metadata.first_token_id)
        if req.return_logprob:
            req.output_logprobs.append(metadata.first_token_logprob)
            if req.top_logprobs_num:
                req.output_top_logprobs.append(list(metadata.top_logprobs)[: req.top_logprobs_num])
        self.counters.prompt_tokens += len(req.origin_input_ids)
        self.counters.generation_tokens += 1
        req.check_finished()
        if req.finished():
            self.finish_and_release(req, req.finished_reason)
            return
        self.ops.cache_unfinished(req)
        self.running_batch.merge(ScheduleBatch([req], ForwardMode.DECODE))
        self.emit([req])

    def record_transfer(self, req: Req) -> None:
        """The whole prompt KV arrived: the leg's transfer span and metrics."""
        started, pages = self.transfer_started.pop(id(req), (time.monotonic(), 0))
        layout = self.kv_manager.layout
        nbytes = layout.transfer_bytes(pages)
        req.trace.transfer(nbytes, pages)
        req.trace.set(ATTR_CACHED_TOKENS, req.cached_tokens)
        if self.metrics is not None:
            self.metrics.transfer.done(nbytes, pages, time.monotonic() - started)
            self.metrics.decode.prebuilt.inc()

    # ---- endings -------------------------------------------------------------------------------

    def fail_transfer(self, req: Req) -> None:
        reason = self.receivers[id(req)].failure_reason() or "KV transfer failed"
        if self.metrics is not None:
            self.metrics.transfer.failed(transfer_failure_kind(reason))
        req.error = (f"KV transfer for room {req.room} failed: {reason}", transfer_error_code(reason))
        self.quarantine_leg(req, reason)

    def fail_leg(self, req: Req, message: str) -> None:
        receiver = self.receivers.get(id(req))
        if receiver is not None:
            receiver.abort(message)
        self.prealloc_queue = [r for r in self.prealloc_queue if r is not req]
        self.transfer_queue = [r for r in self.transfer_queue if r is not req]
        self.quarantine_leg(req, message)

    def quarantine_leg(self, req: Req, message: str) -> None:
        """End the leg now; free its pages only after late WRITEs can no longer land in them."""
        self.receivers.pop(id(req), None)
        self.transfer_started.pop(id(req), None)
        req.finished_reason = FinishReason("abort", message=message)
        self.counters.num_aborts += 1
        self.emit([req])
        if req.req_pool_idx is not None:
            self.quarantine.append((time.monotonic() + QUARANTINE_S, req))

    def release_quarantine(self) -> None:
        now = time.monotonic()
        due = [req for until, req in self.quarantine if until <= now]
        self.quarantine = [(until, req) for until, req in self.quarantine if until > now]
        for req in due:
            self.ops.release(req)

    # ---- loop --------------------------------------------------------------------------------------

    def is_idle(self) -> bool:
        return super().is_idle() and not self.prealloc_queue and not self.transfer_queue and not self.quarantine

    def idle_wait(self) -> float:
        if self.prealloc_queue or self.transfer_queue or self.quarantine:
            return 0.0 if not super().is_idle() else 0.002
        return super().idle_wait()

    def extra_queued_reqs(self) -> list[Req]:
        return self.prealloc_queue + self.transfer_queue

    def queue_sizes(self) -> dict:
        return {**super().queue_sizes(), "prealloc": len(self.prealloc_queue),
                "transfer": len(self.transfer_queue), "quarantine": len(self.quarantine)}

    def close(self) -> None:
        self.kv_manager.close()
