"""Scheduler: receive → schedule → run → process, in the `normal` or `overlap` event loop (seed 003)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

from common.config import EngineConfig
from common.model.forward_batch import ForwardMode
from common.scheduler.io_struct import AbortRequest, FinishReason, GenerateRequest, TokenOutput
from common.scheduler.kv_cache_ops import KVCacheOps
from common.scheduler.model_worker import ModelWorker, OverlapWorker
from common.scheduler.output import OutputBuilder
from common.scheduler.prefill_adder import AddResult, PrefillAdder, sort_waiting_queue
from common.scheduler.req import Req
from common.scheduler.schedule_batch import BatchResult, ScheduleBatch

logger = logging.getLogger(__name__)


@dataclass
class SchedulerCounters:
    num_retractions: int = 0
    num_aborts: int = 0
    num_finished: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    forward_steps: int = 0


class ControlCall:
    """A function to run on the scheduler thread (flush cache, stats), with its result."""

    def __init__(self, fn: Callable[["Scheduler"], object]):
        self.fn = fn
        self.done = threading.Event()
        self.result: object = None
        self.error: Optional[BaseException] = None

    def run(self, scheduler: "Scheduler") -> None:
        """A failing call (a profiler that cannot start, say) fails its caller, not the scheduler loop."""
        try:
            self.result = self.fn(scheduler)
        except Exception as e:  # noqa: BLE001 - re-raised on the caller's thread by Engine.call
            self.error = e
        finally:
            self.done.set()


class Scheduler:
    def __init__(self, config: EngineConfig, worker: ModelWorker, ops: KVCacheOps,
                 stop_ids: set[int], max_context_len: int,
                 output_sink: Callable[[list[TokenOutput]], None]):
        self.config = config
        self.worker = worker
        self.ops = ops
        self.eos_ids = stop_ids
        self.max_context_len = max_context_len
        self.output_sink = output_sink
        self.outputs = OutputBuilder()
        self.inbox: "queue.Queue" = queue.Queue()
        self.waiting_queue: list[Req] = []
        self.running_batch = ScheduleBatch([], ForwardMode.DECODE)
        self.chunked_req: Optional[Req] = None
        self.last_batch: Optional[ScheduleBatch] = None
        self.new_token_ratio = config.init_new_token_ratio
        self.ratio_decay = (config.init_new_token_ratio - config.min_new_token_ratio) / max(
            config.new_token_ratio_decay_steps, 1)
        self.counters = SchedulerCounters()
        self.overlap: Optional[OverlapWorker] = OverlapWorker(worker) if config.event_loop == "overlap" else None
        self.stop_event = threading.Event()
        self.crash: Optional[BaseException] = None
        self.cur_batch: Optional[ScheduleBatch] = None
        # Publish each finished chunk to the tree cache (a PD prefill keeps its pages private until the
        # KV transfer is done, so no page it is sending can be freed as a duplicate).
        self.cache_prefill_chunks = True
        # A worker's WorkerMetrics; None in the offline engine, so every use is guarded.
        self.metrics = None

    # ---- receive -------------------------------------------------------------------------------

    def recv_requests(self, wait: float) -> list:
        """Drain the inbox; wait up to `wait` seconds for the first message when there is nothing to do."""
        msgs = []
        try:
            msgs.append(self.inbox.get(timeout=wait) if wait > 0 else self.inbox.get_nowait())
            while True:
                msgs.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        return msgs

    def process_input_requests(self, msgs: list) -> None:
        for msg in msgs:
            if isinstance(msg, GenerateRequest):
                self.handle_generate(msg)
            elif isinstance(msg, AbortRequest):
                self.abort(msg.rid, msg.message)
            elif isinstance(msg, ControlCall):
                msg.run(self)
            elif msg is None:
                self.stop_event.set()

    def make_reqs(self, msg: GenerateRequest) -> list[Req]:
        params = msg.sampling_params
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        reqs = [Req(msg.rid, i, msg.input_ids, params, stop_ids, msg.return_logprob,
                    msg.top_logprobs_num, msg.logprob_start_len, self.max_context_len)
                for i in range(params.n)]
        for req in reqs:
            req.trace = msg.trace
        if self.ops.caching:
            for sibling in reqs[1:]:
                sibling.blocked_by = reqs[0]  # share the prompt's KV through the tree cache
        return reqs

    def handle_generate(self, msg: GenerateRequest) -> None:
        self.waiting_queue.extend(self.make_reqs(msg))

    def abort(self, rid: str, message: str) -> None:
        waiting = [r for r in self.waiting_queue if r.rid == rid and r is not self.chunked_req]
        if waiting:
            self.waiting_queue = [r for r in self.waiting_queue if r.rid != rid or r is self.chunked_req]
            for req in waiting:
                self.finish_and_release(req, FinishReason("abort", message=message))
        for req in self.live_reqs():
            if req.rid == rid and not req.finished():
                req.to_abort = message  # honoured when its current step's result is processed

    def live_reqs(self) -> list[Req]:
        """Requests past the waiting queue: decoding, being chunked, or in the extend batch in flight."""
        reqs = list(self.running_batch.reqs)
        if self.chunked_req is not None:
            reqs.append(self.chunked_req)
        for batch in (self.last_batch, self.cur_batch):
            if batch is not None and batch.mode is ForwardMode.EXTEND:
                reqs.extend(r for r in batch.reqs if r not in reqs)
        return reqs

    # ---- schedule ------------------------------------------------------------------------------

    def get_next_batch_to_run(self) -> Optional[ScheduleBatch]:
        last = self.last_batch
        if last is not None and last.mode is ForwardMode.EXTEND:
            last.filter(lambda r: not r.is_chunked and not r.finished())
            self.running_batch.merge(last)
        new_batch = self.get_new_batch_prefill()
        if new_batch is not None:
            return new_batch
        return self.update_running_batch()

    def get_new_batch_prefill(self) -> Optional[ScheduleBatch]:
        if self.chunked_req is not None:
            if self.chunked_req.to_abort is not None:
                self.finish_and_release(self.chunked_req, FinishReason("abort", message=self.chunked_req.to_abort))
                self.chunked_req = None
            elif self.cache_prefill_chunks:
                self.ops.cache_unfinished(self.chunked_req)
        if not self.waiting_queue and self.chunked_req is None:
            return None
        running = self.running_batch.reqs
        free_slots = self.config.max_running_requests - len([r for r in running if not r.finished()])
        if free_slots <= 0 and self.chunked_req is None:
            return None
        sort_waiting_queue(self.waiting_queue, self.config.schedule_policy, self.ops)
        adder = PrefillAdder(self.ops, running, self.new_token_ratio, self.config.max_prefill_tokens,
                             self.config.chunked_prefill_size, free_slots)
        if self.chunked_req is not None:
            adder.add_chunked_req(self.chunked_req)
        for req in self.waiting_queue:
            if req.blocked_by is not None and not (req.blocked_by.prefill_done or req.blocked_by.finished()):
                continue
            if req.req_pool_idx is None:
                self.ops.match_prefix(req)
            if adder.add_one_req(req) is not AddResult.CONTINUE:
                break
        if not adder.can_run_list:
            return None
        batch = ScheduleBatch(adder.can_run_list, ForwardMode.EXTEND)
        if not batch.prepare_for_extend(self.ops, self.worker.device):
            for req in adder.can_run_list:
                if req is not self.chunked_req:
                    self.ops.unlock(req)
            return None
        admitted = {id(r) for r in adder.can_run_list}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        continuing, self.chunked_req = self.chunked_req, adder.new_chunked_req
        for req in adder.can_run_list:
            if req is not continuing and not req.is_retracted:
                self.on_admitted(req)
            req.is_retracted = False
            self.ops.record_admission(req)
        return batch

    def on_admitted(self, req: Req) -> None:
        """A request left the waiting queue for its first forward pass."""
        req.trace.mark("queue_wait_end")
        if self.metrics is not None:
            self.metrics.requests.queue_time.observe(time.monotonic() - req.arrival_time)

    def update_running_batch(self) -> Optional[ScheduleBatch]:
        batch = self.running_batch
        batch.filter(lambda r: not r.finished())
        if batch.is_empty():
            return None
        while not batch.prepare_for_decode(self.ops, self.worker.device):
            if not self.ops.evict_for(len(batch) * self.ops.page_size) and not self.retract_one(batch):
                return None
        self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.config.min_new_token_ratio)
        decode = ScheduleBatch(list(batch.reqs), ForwardMode.DECODE)
        decode.epochs, decode.work = list(batch.epochs), batch.work
        decode.chunked = [False] * len(decode.reqs)
        return decode

    def retract_one(self, batch: ScheduleBatch) -> bool:
        """KV ran out: send the request with the least progress back to the waiting queue."""
        if len(batch) <= 1:
            victim = batch.reqs[0]
            self.finish_and_release(victim, FinishReason("abort", message=(
                "KV cache pool exhausted: the request does not fit even alone; "
                "raise --max-total-tokens or lower max_new_tokens")))
            batch.filter(lambda r: r is not victim)
            return bool(batch.reqs)
        victim = min(batch.reqs, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        batch.filter(lambda r: r is not victim)
        self.ops.release(victim)
        victim.reset_for_retract()
        self.waiting_queue.insert(0, victim)
        self.counters.num_retractions += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)
        logger.info("retracted %r to free KV (running=%d)", victim, len(batch))
        return True

    # ---- run -----------------------------------------------------------------------------------

    def run_batch(self, batch: ScheduleBatch):
        work = batch.work
        self.counters.forward_steps += 1
        if self.overlap is None:
            self.worker.prepare(work)
            return self.worker.run(work)
        futures = self.worker.alloc_futures(len(batch))
        work.future_indices = futures
        for req, chunked, fut in zip(batch.reqs, batch.chunked, futures.tolist()):
            if not chunked:
                req.pending_future = fut
        return self.overlap.launch(work)

    # ---- process -------------------------------------------------------------------------------

    def process_batch_result(self, batch: ScheduleBatch, result: BatchResult) -> None:
        touched = []
        futures = batch.work.future_indices
        future_ids = futures.tolist() if futures is not None else None  # once, not a tensor read per request
        for i, (req, epoch, chunked) in enumerate(zip(batch.reqs, batch.epochs, batch.chunked)):
            if req.epoch != epoch:
                continue
            if future_ids is not None and req.pending_future == future_ids[i]:
                req.pending_future = None
            if req.finished():
                continue  # ended (aborted, or finished in the overlap loop's extra step) while in flight
            if batch.mode is ForwardMode.EXTEND:
                self.outputs.add_input_logprobs(req, result.input_logprobs[i], batch.work, i)
                self.on_chunk_computed(req, batch.work.forward_batch.extend_seq_lens_cpu[i])
                if chunked:
                    self.on_prefill_chunk(req, batch.work.forward_batch.seq_lens_cpu[i])
                    continue
                req.prefill_done = True
                req.trace.mark("forward_end")
                self.counters.prompt_tokens += len(req.origin_input_ids)
                if self.on_prefill_done(req, result, i):
                    touched.append(req)
                continue
            self.append_token(req, result, i)
            touched.append(req)
            if req.finished():
                self.finish_and_release(req, req.finished_reason, emit=False)
        self.emit(touched)

    def on_chunk_computed(self, req: Req, n_tokens: int) -> None:
        """One extend of `n_tokens` prompt tokens (a chunk, or the whole prompt) was computed."""
        req.trace.chunk(n_tokens)

    def on_prefill_chunk(self, req: Req, computed_len: int) -> None:
        """KV of the prompt's first `computed_len` tokens now exists (in the overlap loop the request
        may already be scheduled further; its own kv_len runs ahead of what is computed)."""

    def on_prefill_done(self, req: Req, result: BatchResult, i: int) -> bool:
        """The whole prompt is computed and its first token sampled; True if there is output to emit."""
        if req.sampling_params.max_new_tokens == 0:
            self.finish_and_release(req, FinishReason("length"), emit=False)
            return True
        self.append_token(req, result, i)
        if req.finished():
            self.finish_and_release(req, req.finished_reason, emit=False)
        else:
            self.ops.cache_unfinished(req)
        return True

    def append_token(self, req: Req, result: BatchResult, i: int) -> None:
        req.output_ids.append(result.next_token_ids[i])
        if req.return_logprob and result.logprobs is not None:
            req.output_logprobs.append(result.logprobs[i])
            if result.top_logprobs is not None and req.top_logprobs_num > 0:
                req.output_top_logprobs.append(result.top_logprobs[i])
        self.counters.generation_tokens += 1
        req.check_finished()

    def finish_and_release(self, req: Req, reason: FinishReason, emit: bool = True) -> None:
        req.finished_reason = reason
        if reason.kind == "abort":
            self.counters.num_aborts += 1
            self.ops.release(req)
        else:
            self.counters.num_finished += 1
            self.ops.cache_finished(req)
        if emit:
            self.emit([req])

    def emit(self, reqs: list[Req]) -> None:
        outs = [o for o in (self.outputs.build(r) for r in reqs) if o is not None]
        if outs:
            self.output_sink(outs)

    # ---- event loops -----------------------------------------------------------------------------

    def event_loop_normal(self) -> None:
        while not self.stop_event.is_set():
            self.process_input_requests(self.recv_requests(self.idle_wait()))
            batch = self.cur_batch = self.get_next_batch_to_run()
            if batch is not None:
                result = self.run_batch(batch)
                self.process_batch_result(batch, result)
            self.last_batch = batch

    def event_loop_overlap(self) -> None:
        in_flight: deque = deque()
        while not self.stop_event.is_set():
            self.process_input_requests(self.recv_requests(0.0 if in_flight else self.idle_wait()))
            batch = self.cur_batch = self.get_next_batch_to_run()
            if batch is not None:
                in_flight.append((batch.snapshot(), self.run_batch(batch)))
            # Process batch N only after batch N+1 is launched: the CPU work overlaps the compute.
            if in_flight and (batch is None or len(in_flight) > 1):
                done_batch, future = in_flight.popleft()
                self.process_batch_result(done_batch, future.result())
            self.last_batch = batch
        while in_flight:
            done_batch, future = in_flight.popleft()
            self.process_batch_result(done_batch, future.result())

    def is_idle(self) -> bool:
        return not self.waiting_queue and self.running_batch.is_empty() and self.chunked_req is None \
            and self.last_batch is None

    def idle_wait(self) -> float:
        """How long the loop may sleep on its inbox: long when idle, not at all while batches run."""
        return 0.05 if self.is_idle() else 0.0

    def queue_sizes(self) -> dict:
        """Requests per queue; every queue is empty once all requests have ended."""
        return {"waiting": len(self.waiting_queue), "running": len(self.running_batch.reqs),
                "chunked": int(self.chunked_req is not None)}

    def close(self) -> None:
        """Release what the scheduler owns beyond its thread (the PD roles close their KV manager)."""

    def run_forever(self) -> None:
        loop = self.event_loop_overlap if self.overlap is not None else self.event_loop_normal
        try:
            loop()
        except Exception as e:
            # A bug must not leave callers waiting forever: fail every request and refuse new work.
            logger.exception("scheduler loop crashed")
            self.crash = e
            self.fail_everything(f"internal error: scheduler crashed ({type(e).__name__}: {e})")
        finally:
            if self.overlap is not None:
                self.overlap.shutdown()

    def fail_everything(self, message: str) -> None:
        reqs = self.waiting_queue + self.live_reqs() + self.extra_queued_reqs()
        for msg in self.recv_requests(0.0):
            if isinstance(msg, ControlCall):
                msg.done.set()
            elif isinstance(msg, GenerateRequest):  # still in the inbox: its caller waits on it too
                reqs.extend(self.make_reqs(msg))
        for req in reqs:
            if not req.finished():
                req.error = (message, "INTERNAL")
                req.finished_reason = FinishReason("abort", message=message)
        self.emit([r for r in reqs if r.error is not None])

    def extra_queued_reqs(self) -> list[Req]:
        """Requests in a role's own queues (bootstrap, inflight, prealloc, transfer)."""
        return []

