"""The unified scheduler (offline engine, `tandem worker`): every request is prefilled and decoded here, in the
`normal` or `overlap` event loop of seed 003 — receive → schedule → run → process."""

from __future__ import annotations

from typing import Optional

from tandem.common.scheduler.batcher import Batcher, TokenRatio
from tandem.common.scheduler.embedder import Embedder
from tandem.common.scheduler.grammar_queue import GrammarQueue
from tandem.common.scheduler.io_struct import AbortRequest, EmbedRequest, GenerateRequest
from tandem.common.scheduler.loop import IDLE_WAIT_S, POLL_WAIT_S, ControlCall, Inbox
from tandem.common.scheduler.model_worker import BatchRunner, InFlight
from tandem.common.scheduler.output import OutputProcessor
from tandem.common.scheduler.parts import SchedulerParts
from tandem.common.scheduler.req import Req, reqs_from_request
from tandem.common.scheduler.schedule_batch import ScheduleBatch


class Scheduler:
    def __init__(self, parts: SchedulerParts):
        self.parts = parts
        self.config = parts.config
        self.ops = parts.ops
        self.inbox = Inbox()
        self.outputs = OutputProcessor(parts.ops, parts.sink)
        self.batcher = Batcher(parts.config, parts.ops, parts.worker.device, self.outputs, parts.metrics.requests,
                               TokenRatio.of(parts.config), mix_decode=parts.config.enable_mixed_chunk)
        self.runner = BatchRunner(parts.worker, overlap=parts.config.event_loop == "overlap")
        self.grammar_queue = GrammarQueue(self.outputs)  # constrained requests whose grammar is compiling
        self.embedder = Embedder(parts.ops, self.runner, parts.worker.device, parts.config.embedding_pooling,
                                 parts.config.max_prefill_tokens)
        self.last_batch: Optional[ScheduleBatch] = None
        self.cur_batch: Optional[ScheduleBatch] = None
        self.stopped = False
        self.crash: Optional[BaseException] = None

    # ---- receive -------------------------------------------------------------------------------

    def process_input_requests(self, msgs: list) -> None:
        for msg in msgs:
            if isinstance(msg, GenerateRequest):
                self.batcher.waiting_queue.extend(self.grammar_queue.admit(self.make_reqs(msg)))
            elif isinstance(msg, EmbedRequest):
                self.embedder.add(msg)
            elif isinstance(msg, AbortRequest):
                self.embedder.abort(msg.rid)
                self.grammar_queue.abort(msg.rid, msg.message)
                self.batcher.abort(msg.rid, msg.message, self.live_reqs())
            elif isinstance(msg, ControlCall):
                msg.run(self)
            elif msg is Inbox.STOP:
                self.stopped = True

    def make_reqs(self, msg: GenerateRequest) -> list[Req]:
        return reqs_from_request(msg, self.parts.eos_token_ids, self.parts.max_context_len, self.ops.caching,
                                 self.parts.grammar)

    def pop_grammar_ready(self) -> None:
        self.batcher.waiting_queue.extend(self.grammar_queue.pop_ready())

    # ---- event loops -----------------------------------------------------------------------------

    def event_loop_normal(self) -> None:
        while not self.stopped:
            self.process_input_requests(self.inbox.recv(self.idle_wait()))
            self.pop_grammar_ready()
            self.embedder.run_batch()
            batch = self.cur_batch = self.batcher.get_next_batch_to_run(self.last_batch)
            if batch is not None:
                result = self.runner.run(batch)
                self.outputs.process_batch_result(batch, result)
            self.last_batch = batch

    def event_loop_overlap(self) -> None:
        in_flight = InFlight(self.runner)
        while not self.stopped:
            self.process_input_requests(self.inbox.recv(0.0 if in_flight else self.idle_wait()))
            self.pop_grammar_ready()
            self.embedder.run_batch()
            batch = self.cur_batch = self.batcher.get_next_batch_to_run(self.last_batch)
            if batch is not None:
                in_flight.launch(batch)
            if (previous := in_flight.pop_previous(launched_now=batch is not None)) is not None:
                self.outputs.process_batch_result(*previous)
            in_flight.fill_grammar_mask()  # after the previous step's tokens advanced the matchers
            self.last_batch = batch
        for previous in in_flight.drain():
            self.outputs.process_batch_result(*previous)

    # ---- state -----------------------------------------------------------------------------------

    def idle_wait(self) -> float:
        """How long the loop may sleep on its inbox: long when idle, not at all while batches run."""
        if self.last_batch is not None:
            return 0.0
        polling = self.embedder or self.grammar_queue
        if not self.batcher.idle():  # only a held prefill (a decode would have run): sleep until its hold ends
            return min(self.batcher.held_wait(), POLL_WAIT_S) if polling else self.batcher.held_wait()
        return POLL_WAIT_S if polling else IDLE_WAIT_S

    def queue_sizes(self) -> dict:
        """Requests per queue; every queue is empty once all requests have ended."""
        return {**self.batcher.queue_sizes(), "grammar": len(self.grammar_queue), "embed": len(self.embedder)}

    def live_reqs(self) -> list[Req]:
        """Requests past the waiting queue: running, being chunked, or in a batch not processed yet."""
        return self.batcher.live_reqs(self.last_batch, self.cur_batch)

    def load(self) -> tuple[int, int]:
        """(running, waiting) requests, as GetLoads and the router's policies count them."""
        return len(self.batcher.running_batch.reqs) + int(self.batcher.chunked_req is not None), \
            len(self.batcher.waiting_queue) + len(self.grammar_queue)

    def fail_everything(self, message: str) -> None:
        self.embedder.fail_all(message)
        reqs = self.grammar_queue.fail_all() + self.batcher.waiting_queue + self.live_reqs()
        for msg in self.inbox.drain_after_crash():
            reqs.extend(self.make_reqs(msg))
        self.outputs.fail(reqs, message)

    def close(self) -> None:
        """Nothing beyond the scheduler thread to release."""
