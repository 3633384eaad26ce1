"""The unified scheduler (offline engine, `tandem worker`): every request is prefilled and decoded here, in the
`normal` or `overlap` event loop of seed 003 — receive → schedule → run → process."""

from __future__ import annotations

from tandem.common.scheduler.base import SchedulerBase
from tandem.common.scheduler.batcher import TokenRatio
from tandem.common.scheduler.io_struct import AbortRequest, EmbedRequest, GenerateRequest
from tandem.common.scheduler.loop import ControlCall, Inbox
from tandem.common.scheduler.model_worker import InFlight
from tandem.common.scheduler.parts import SchedulerParts
from tandem.common.scheduler.req import Req, reqs_from_request


class Scheduler(SchedulerBase):
    def __init__(self, parts: SchedulerParts):
        super().__init__(parts, TokenRatio.of(parts.config), mix_decode=parts.config.enable_mixed_chunk)

    # ---- receive -------------------------------------------------------------------------------

    def process_input_requests(self, msgs: list) -> None:
        for msg in msgs:
            if isinstance(msg, GenerateRequest):
                reqs = self.ops.prefetch(self.make_reqs(msg))
                self.batcher.waiting_queue.extend(self.grammar_queue.admit(reqs))
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
