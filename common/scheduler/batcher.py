"""Batcher: the waiting queue, the request being chunked and the running batch, and how the next extend or
decode batch is built from them (SGLang's get_new_batch_prefill / update_running_batch, with retraction)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

from tandem.common.config import EngineConfig
from tandem.common.model.forward_batch import ForwardMode
from tandem.common.scheduler.io_struct import FinishReason
from tandem.common.scheduler.kv_cache_ops import KVCacheOps
from tandem.common.scheduler.output import OutputProcessor
from tandem.common.scheduler.prefill_adder import AddResult, PrefillAdder, sort_waiting_queue
from tandem.common.scheduler.req import Req
from tandem.common.scheduler.schedule_batch import ScheduleBatch
from tandem.common.telemetry.metrics import RequestMetrics

logger = logging.getLogger(__name__)


@dataclass
class TokenRatio:
    """Admission's guess of the fraction of max_new_tokens a running request still needs: it starts at `init`,
    decays to `min` over `decay_steps` decode steps, and rises after each retraction."""

    init: float
    min: float
    decay_steps: int

    @classmethod
    def of(cls, config: EngineConfig) -> "TokenRatio":
        return cls(config.init_new_token_ratio, config.min_new_token_ratio, config.new_token_ratio_decay_steps)

    @classmethod
    def none(cls) -> "TokenRatio":
        """For a scheduler whose requests never decode here: reserve nothing."""
        return cls(0.0, 0.0, 1)

    @property
    def step(self) -> float:
        return (self.init - self.min) / max(self.decay_steps, 1)


class Batcher:
    def __init__(self, config: EngineConfig, ops: KVCacheOps, device, outputs: OutputProcessor,
                 request_metrics: RequestMetrics, token_ratio: TokenRatio, mix_decode: bool = False):
        self.config = config
        self.mix_decode = mix_decode  # --enable-mixed-chunk: a prefill carries the running requests' decode step
        self.ops = ops
        self.device = device
        self.outputs = outputs
        self.request_metrics = request_metrics
        self.ratio = token_ratio
        self.new_token_ratio = token_ratio.init
        self.waiting_queue: list[Req] = []
        self.running_batch = ScheduleBatch([], ForwardMode.DECODE)
        self.chunked_req: Optional[Req] = None
        self.paused = False  # pause_generation: nothing is scheduled until continue_generation
        self.hold_until: Optional[float] = None  # a prefill held back for more arrivals, until then (monotonic)

    # ---- queue changes -------------------------------------------------------------------------

    def abort(self, rid: str, message: str, in_flight: list[Req]) -> None:
        """End the request's waiting sequences now; mark its running ones (in `in_flight`, the requests past
        the waiting queue) to end when their current step's result is processed."""
        waiting = [r for r in self.waiting_queue if r.rid == rid and r is not self.chunked_req]
        if waiting:
            self.waiting_queue = [r for r in self.waiting_queue if r.rid != rid or r is self.chunked_req]
            for req in waiting:
                self.outputs.finish(req, FinishReason("abort", message=message))
        for req in in_flight:
            if req.rid == rid and not req.finished():
                req.to_abort = message

    def live_reqs(self, *batches: Optional[ScheduleBatch]) -> list[Req]:
        """Requests past the waiting queue: decoding, being chunked, or in one of the extend `batches`."""
        reqs = list(self.running_batch.reqs)
        if self.chunked_req is not None:
            reqs.append(self.chunked_req)
        for batch in batches:
            if batch is not None and batch.mode is ForwardMode.EXTEND:
                reqs.extend(r for r in batch.reqs if r not in reqs)
        return reqs

    def merge_prefilled(self, last_batch: Optional[ScheduleBatch]) -> None:
        """The last extend batch's finished prompts join the running batch."""
        if last_batch is not None and last_batch.mode is ForwardMode.EXTEND:
            prefilled = last_batch.prefill_part()  # mixed-in decode rows are in the running batch already
            prefilled.filter(lambda r: not r.is_chunked and not r.finished())
            self.running_batch.merge(prefilled)

    # ---- the next batch -------------------------------------------------------------------------------

    def get_next_batch_to_run(self, last_batch: Optional[ScheduleBatch]) -> Optional[ScheduleBatch]:
        """For a scheduler that decodes what it prefills: new prompts first, else one decode step."""
        self.merge_prefilled(last_batch)
        chunked = self.chunked_req
        if chunked is not None and chunked.to_abort is None:
            self.ops.cache_unfinished(chunked)  # later prompts may reuse the chunks computed so far
        prefill = self.get_new_batch_prefill()
        if prefill is None:
            return self.update_running_batch()
        return self.mix_with_running(prefill) if self.mix_decode else prefill

    def mix_with_running(self, prefill: ScheduleBatch) -> ScheduleBatch:
        """--enable-mixed-chunk: the running requests take their next decode step in the prefill's forward instead
        of stalling behind it (SGLang's mix_with_running). When their pages do not fit, the prefill runs alone and
        the next decode step retracts as usual."""
        running = self.running_batch
        running.filter(lambda r: not r.finished())
        if not running.is_empty() and running.prepare_for_decode(self.ops, self.device):
            prefill.mix(self._decode_step())
        return prefill

    def get_new_batch_prefill(self) -> Optional[ScheduleBatch]:
        """Admit waiting requests (and the next chunk of the chunked one) under the token budgets."""
        self.hold_until = None
        if self.paused:
            return None
        if self.chunked_req is not None and self.chunked_req.to_abort is not None:
            # Aborted while being chunked: it ends before its next chunk is scheduled.
            self.outputs.finish(self.chunked_req, FinishReason("abort", message=self.chunked_req.to_abort))
            self.chunked_req = None
        if not self.waiting_queue and self.chunked_req is None:
            return None
        running = self.running_batch.reqs
        decoding = len([r for r in running if not r.finished()])
        free_slots = self.config.max_running_requests - decoding
        if free_slots <= 0 and self.chunked_req is None:
            return None
        if self.chunked_req is None and self.hold_prefill(free_slots):
            return None
        sort_waiting_queue(self.waiting_queue, self.config.schedule_policy, self.ops)
        # Mixed with the running requests' decode step, the forward's token budgets hold one token for each.
        mixed_rows = decoding if self.mix_decode else 0
        chunk = self.config.prefill_chunk
        adder = PrefillAdder(self.ops, running, self.new_token_ratio, max(self.config.max_prefill_tokens - mixed_rows, 1),
                             max(chunk - mixed_rows, self.ops.page_size) if chunk > 0 else chunk, free_slots)
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
        return self._admit(adder)

    def hold_prefill(self, free_slots: int) -> bool:
        """Requests are still arriving in a burst (the replacements of a wave of finished streams, a client's
        concurrent first requests): hold the prefill back until none arrived for --prefill-wait-ms, the oldest has
        waited --prefill-wait-max-ms, or the waiting requests fill the free slots. The running batch decodes
        meanwhile; the burst is then prefilled as one batch instead of a step per trickle, each stalling every
        running stream, and its requests stay in step with each other afterwards."""
        gap = self.config.prefill_wait_ms / 1000
        if gap <= 0 or len(self.waiting_queue) >= free_slots:
            return False
        arrivals = [r.arrival_time for r in self.waiting_queue]
        until = min(max(arrivals) + gap, min(arrivals) + self.config.prefill_wait_max_ms / 1000)
        if time.monotonic() >= until:
            return False
        self.hold_until = until
        return True

    def held_wait(self) -> float:
        """Seconds the loop may sleep on its inbox for a held prefill (a new arrival wakes it sooner); 0 if none."""
        return max(self.hold_until - time.monotonic(), 0.0) if self.hold_until is not None else 0.0

    def _admit(self, adder: PrefillAdder) -> Optional[ScheduleBatch]:
        batch = ScheduleBatch(adder.can_run_list, ForwardMode.EXTEND)
        if not batch.prepare_for_extend(self.ops, self.device):
            for req in adder.can_run_list:
                if req is not self.chunked_req:
                    self.ops.unlock(req)
            return None
        admitted = {id(r) for r in adder.can_run_list}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        continuing, self.chunked_req = self.chunked_req, adder.new_chunked_req
        for req in adder.can_run_list:
            if req is not continuing and not req.is_retracted:
                req.trace.mark("queue_wait_end")
                self.request_metrics.queue_time.observe(time.monotonic() - req.arrival_time)
            req.is_retracted = False
            self.ops.record_admission(req)
        return batch

    def update_running_batch(self) -> Optional[ScheduleBatch]:
        """One more token for every running request, retracting the least advanced while KV runs short."""
        batch = self.running_batch
        batch.filter(lambda r: not r.finished())
        if batch.is_empty() or self.paused:
            return None
        while not batch.prepare_for_decode(self.ops, self.device):
            if not self.ops.evict_for(len(batch) * self.ops.page_size) and not self.retract_one(batch):
                return None
        return self._decode_step()

    def _decode_step(self) -> ScheduleBatch:
        """The prepared running batch's step as a batch of its own (the running batch goes on changing)."""
        batch = self.running_batch
        self.new_token_ratio = max(self.new_token_ratio - self.ratio.step, self.ratio.min)
        decode = ScheduleBatch(list(batch.reqs), ForwardMode.DECODE)
        decode.epochs, decode.work = list(batch.epochs), batch.work
        decode.chunked = [False] * len(decode.reqs)
        return decode

    def retract_one(self, batch: ScheduleBatch) -> bool:
        """KV ran out: send the request with the least progress back to the waiting queue."""
        if len(batch) <= 1:
            victim = batch.reqs[0]
            self.outputs.finish(victim, FinishReason("abort", message=(
                "KV cache pool exhausted: the request does not fit even alone; "
                "raise --max-total-tokens or lower max_new_tokens")))
            batch.filter(lambda r: r is not victim)
            return bool(batch.reqs)
        victim = min(batch.reqs, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        batch.filter(lambda r: r is not victim)
        self.ops.release(victim)
        victim.reset_for_retract()
        self.waiting_queue.insert(0, victim)
        self.outputs.counters.num_retractions += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)
        logger.info("retracted %r to free KV (running=%d)", victim, len(batch))
        return True

    def retract_all(self) -> int:
        """pause_generation(retract): every running request back to the waiting queue, its KV freed; it is
        recomputed after continue_generation. Call only while no batch is in flight."""
        victims = [r for r in self.running_batch.reqs if not r.finished()]
        self.running_batch.filter(lambda r: False)
        for victim in reversed(victims):
            self.ops.release(victim)
            victim.reset_for_retract()
            self.waiting_queue.insert(0, victim)
        self.outputs.counters.num_retractions += len(victims)
        return len(victims)

    # ---- state ---------------------------------------------------------------------------------

    def idle(self) -> bool:
        """Nothing to schedule now: empty, or paused."""
        return self.paused or self.is_empty()

    def is_empty(self) -> bool:
        return not self.waiting_queue and self.running_batch.is_empty() and self.chunked_req is None

    def queue_sizes(self) -> dict:
        return {"waiting": len(self.waiting_queue), "running": len(self.running_batch.reqs),
                "chunked": int(self.chunked_req is not None)}
