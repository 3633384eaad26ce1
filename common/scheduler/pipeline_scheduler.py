"""The unified scheduler of a pipeline-parallel engine (--pp-size N): seed 003's event_loop_pp, with up to N
micro-batches of disjoint requests in flight, so stage 0 runs micro-batch k+1 while stage 1 runs k.

Rank 0 (stage 0) owns the only scheduler, allocator and radix cache; every stage's KV pool holds its own layers at
the same page indices. The stages run micro-batches in the order stage 0 launched them, so a batch always finds the
KV that any earlier batch wrote (a radix hit, the previous chunk of a prompt) on every stage, and freeing a page
on rank 0 frees it everywhere: nothing is allocated or freed anywhere else.

--event-loop normal runs the inherited normal loop (one micro-batch through all stages at a time); the default
(overlap) runs event_loop_pp, whose pipeline replaces the overlap loop's CPU/forward overlap."""

from __future__ import annotations

import time
from collections import deque
from typing import Optional

from tandem.common.model.forward_batch import ForwardMode
from tandem.common.scheduler.model_worker import ModelWorker
from tandem.common.scheduler.parts import SchedulerParts
from tandem.common.scheduler.req import Req
from tandem.common.scheduler.schedule_batch import BatchResult, ScheduleBatch
from tandem.common.scheduler.scheduler import Scheduler


class MicroBatchRunner:
    """Runs micro-batches through the pipeline (the ModelWorker's model is stage 0's PipelineRunner): `run` the
    whole pipeline for one batch (the normal loop), or `launch` now and `collect` its result later (event_loop_pp).
    Sampling happens here on stage 0, from the last stage's logits, so logprobs, grammar masks and penalties work
    as in a single process."""

    def __init__(self, worker: ModelWorker, pipelined: bool):
        self.worker = worker
        self.pipeline = worker.model
        self.overlap = pipelined  # run_scheduler picks event_loop_overlap, which is event_loop_pp here
        self.model_thread = False  # stage 0 computes on the scheduler thread

    def run(self, batch: ScheduleBatch) -> BatchResult:
        self.launch(batch)
        return self.collect(batch)

    def launch(self, batch: ScheduleBatch) -> None:
        self.worker.prepare(batch.work)
        if self.worker.forward_sleep_s:
            time.sleep(self.worker.forward_sleep_s)
        self.pipeline.launch(batch.work.forward_batch)

    def collect(self, batch: ScheduleBatch) -> BatchResult:
        """The oldest launched batch's result; `batch` must be that batch. Its requests' previous steps were all
        processed before it was scheduled, so their grammar masks can be filled now."""
        logits = self.pipeline.collect()
        if batch.work.grammar_mask is not None:
            batch.work.grammar_mask.fill()
        return self.worker.sample(batch.work, logits)

    def hidden_states(self, batch: ScheduleBatch):
        raise RuntimeError("embeddings are not computed by a pipeline-parallel engine")  # Engine.embed refuses first

    def shutdown(self) -> None:
        """Nothing of its own: the pipeline is closed by the engine."""


class PipelineScheduler(Scheduler):
    def __init__(self, parts: SchedulerParts):
        super().__init__(parts)
        self.runner.shutdown()  # the inherited runner's model thread never ran a batch
        self.runner = MicroBatchRunner(parts.worker, pipelined=parts.config.event_loop == "overlap")
        self.pp_size = parts.config.pp_size
        self.in_flight: deque[ScheduleBatch] = deque()  # launched micro-batches, oldest first

    def event_loop_overlap(self) -> None:
        self.event_loop_pp()

    def event_loop_pp(self) -> None:
        """receive → process the oldest micro-batch when the pipeline is full (or nothing else can run) →
        schedule one of requests not in flight → launch it."""
        while not self.stopped:
            self.process_input_requests(self.inbox.recv(0.0 if self.in_flight else self.idle_wait()))
            self.pop_grammar_ready()
            if len(self.in_flight) >= self.pp_size:
                self.process_oldest()
            batch = self.get_next_micro_batch()
            if batch is not None:
                self.runner.launch(batch)
                self.in_flight.append(batch)
            elif self.in_flight:
                self.process_oldest()  # every runnable request is in flight: wait for the pipeline
            self.last_batch = self.cur_batch = self.in_flight[-1] if self.in_flight else None
        while self.in_flight:
            self.process_oldest()
        self.last_batch = self.cur_batch = None

    def process_oldest(self) -> None:
        batch = self.in_flight[0]
        result = self.runner.collect(batch)
        self.in_flight.popleft()
        self.outputs.process_batch_result(batch, result)
        self.batcher.merge_prefilled(batch)

    # ---- scheduling ----------------------------------------------------------------------------

    def get_next_micro_batch(self) -> Optional[ScheduleBatch]:
        """New prompts first (unless the prompt being chunked is still in flight: its next chunk needs this one's
        result processed), else one decode step of the running requests not in flight."""
        busy = {id(r) for b in self.in_flight for r in b.reqs}
        chunked = self.batcher.chunked_req
        if chunked is None or id(chunked) not in busy:
            if chunked is not None and chunked.to_abort is None:
                self.ops.cache_unfinished(chunked)  # later prompts may reuse the chunks computed so far
            batch = self.batcher.get_new_batch_prefill()
            if batch is not None:
                return batch
        return self.decode_micro_batch(busy)

    def decode_micro_batch(self, busy: set[int]) -> Optional[ScheduleBatch]:
        """One more token for every running request not in flight, retracting among them while KV runs short. With
        other micro-batches in flight, a lone request that does not fit waits for them instead of being aborted."""
        batcher = self.batcher
        batcher.running_batch.filter(lambda r: not r.finished())
        if batcher.paused:
            return None
        batch = ScheduleBatch([r for r in batcher.running_batch.reqs if id(r) not in busy], ForwardMode.DECODE)
        if batch.is_empty():
            return None
        while not batch.prepare_for_decode(self.ops, batcher.device):
            if self.ops.evict_for(len(batch) * self.ops.page_size):
                continue
            if len(batch) == 1 and busy:
                return None
            retracted = batcher.retract_one(batch)
            kept = {id(r) for r in batch.reqs} | busy
            batcher.running_batch.filter(lambda r: id(r) in kept)
            if not retracted:
                return None
        batcher.new_token_ratio = max(batcher.new_token_ratio - batcher.ratio.step, batcher.ratio.min)
        return batch

    # ---- state ---------------------------------------------------------------------------------

    def live_reqs(self) -> list[Req]:
        return self.batcher.live_reqs(*self.in_flight)
