"""ModelWorker runs one ModelWorkBatch (forward + sampling); OverlapWorker runs it on its own thread; BatchRunner
is what a scheduler loop calls, and InFlight holds the overlap loop's launched batches."""

from __future__ import annotations

import concurrent.futures
import time
from collections import deque
from typing import Callable, Iterator, Optional

import torch

from tandem.common.cpu_threads import compute_threads
from tandem.common.model.lora import LoRABatch, LoRAHooks
from tandem.common.model.graph_runner import DecodeGraphRunner
from tandem.common.sampling.sampler import (Sampler, SamplingBatchInfo, compute_input_logprobs,
                                            compute_input_top_logprobs)
from tandem.common.scheduler.schedule_batch import BatchResult, ModelWorkBatch, ScheduleBatch


class ModelWorker:
    """Owns the model and the sampler. `prepare` runs on the scheduler thread (it reads the request
    tables); `run` may run on another thread and only touches tensors snapshotted by `prepare`."""

    def __init__(self, model, kv_pool, vocab_size: int, device, future_capacity: int = 1 << 16,
                 graph_runner: Optional[DecodeGraphRunner] = None):
        self.model = model
        self.graph_runner = graph_runner
        self.kv_pool = kv_pool
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler()
        # Overlap loop: sampled ids of batch N, read as input ids by batch N+1 (future slot -> token id).
        self.future_map = torch.zeros(future_capacity, dtype=torch.int64, device=device)
        self.future_capacity = future_capacity
        self._next_future = 1
        self.forward_sleep_s = 0.0  # slow_down: sleep before each forward pass (tests of timeouts)
        self.lora_hooks: Optional[LoRAHooks] = None  # set when the engine serves LoRA adapters
        self.before_forward: Optional[Callable[[], None]] = None  # EPLB's rebalance check (common/control/experts)

    def alloc_futures(self, n: int) -> torch.Tensor:
        start = self._next_future
        if start + n >= self.future_capacity:
            start = 1
        self._next_future = start + n
        return torch.arange(start, start + n, dtype=torch.int64)

    def prepare(self, work: ModelWorkBatch) -> None:
        """Plan the attention; a decode batch a graph bucket holds is padded to it first."""
        fb = work.forward_batch
        fb.token_to_kv_pool = self.kv_pool
        # Decode graphs hold no LoRA deltas: a batch with an adapter runs eagerly.
        graphs = self.graph_runner is not None and not any(work.lora)
        work.graph_batch = self.graph_runner.pad(fb) if graphs else None
        self.model.attn_backend.init_forward_metadata(work.graph_batch or fb)

    @torch.inference_mode()
    def run(self, work: ModelWorkBatch) -> BatchResult:
        return self.sample(work, self.forward(work))

    def forward(self, work: ModelWorkBatch) -> torch.Tensor:
        """The batch's logits (one row per request, or every scored row), through its graph when it has one."""
        fb = work.forward_batch
        run_fb = work.graph_batch or fb
        ids = run_fb.input_ids
        if self.forward_sleep_s:
            time.sleep(self.forward_sleep_s)
        if self.before_forward is not None:
            self.before_forward()
        if any(f is not None for f in work.pending_futures):
            run_fb.input_ids = torch.where(ids < 0, self.future_map[ids.neg().clamp(min=0)], ids)
            resolved = self.future_map[torch.tensor([f or 0 for f in work.pending_futures])].tolist()
            for hist, fut, tok in zip(work.output_ids, work.pending_futures, resolved):
                if fut is not None and hist is not None:
                    hist.append(tok)
        if self.lora_hooks is not None:
            self.lora_hooks.active = None
            if any(work.lora):  # most steps carry no adapter: no per-request lists built for them
                per_req = [1] * len(work.lora) if fb.is_decode else list(fb.extend_seq_lens_cpu)
                self.lora_hooks.active = LoRABatch.build(work.lora, per_req, fb.input_ids.device)
        if work.graph_batch is not None:
            return self.graph_runner.forward(work.graph_batch, fb.batch_size)[: fb.batch_size]
        return self.model(fb)

    @torch.inference_mode()
    def sample(self, work: ModelWorkBatch, logits: torch.Tensor) -> BatchResult:
        """Next tokens (and logprobs) from the logits, stored for the overlap loop's next batch."""
        fb = work.forward_batch
        spans = work.input_logprob_spans
        if fb.logits_indices is not None:
            last_rows = [start + count - 1 for start, count in self._row_starts(spans)]
            next_logits = logits[torch.tensor(last_rows, device=logits.device)]
        else:
            next_logits = logits
        info = SamplingBatchInfo.build(
            work.sampling_params, work.output_ids, work.prompt_ids, work.seeds, work.sample_positions, work.stop_ids,
            self.vocab_size, logits.device)
        if work.grammar_mask is not None:
            # The overlap loop: the forward ran while the scheduler accepted the previous step's tokens.
            info.vocab_mask = work.grammar_mask.wait(logits.device)
        out = self.sampler.sample(next_logits, info, work.return_logprob, work.top_logprobs_num)
        if work.future_indices is not None:
            self.future_map[work.future_indices.to(self.device)] = out.next_token_ids
        result = BatchResult(next_token_ids=out.next_token_ids.tolist())
        if out.logprobs is not None:
            result.logprobs = out.logprobs.tolist()
        if out.top_logprob_ids is not None:
            result.top_logprobs = [list(zip(i, v)) for i, v in zip(out.top_logprob_ids, out.top_logprob_vals)]
        result.input_logprobs = self._input_logprobs(logits, fb, spans)
        result.input_top_logprobs = self._input_top_logprobs(logits, spans, result.input_logprobs,
                                                             work.top_logprobs_num)
        return result

    @staticmethod
    def _row_starts(spans: list[Optional[tuple[int, int]]]) -> list[tuple[int, int]]:
        """Map each request to its (start, count) rows in the logits; plain requests have one row."""
        rows, cursor = [], 0
        for span in spans:
            count = span[0] if span is not None else 1
            rows.append((cursor, count))
            cursor += count
        return rows

    def _input_logprobs(self, logits, fb, spans) -> list[Optional[list[float]]]:
        """Row j of a request's extend predicts its token j+1; the last row predicts the next input
        token when the prompt continues in a later chunk, else the first output token (skipped)."""
        if fb.logits_indices is None:
            return [None] * len(spans)
        # Every scored row of every request in one pass, then split per request.
        row_ids, target_ids, counts = [], [], []
        token_start = 0
        for (start, count), span, n in zip(self._row_starts(spans), spans, fb.extend_seq_lens_cpu):
            if span is not None:
                targets = fb.input_ids[token_start + 1: token_start + count]
                rows = count - 1
                if span[1] >= 0:
                    targets = torch.cat([targets, targets.new_tensor([span[1]])])
                    rows = count
                row_ids.append(torch.arange(start, start + rows, device=logits.device))
                target_ids.append(targets)
                counts.append(rows)
            token_start += n
        if not counts:
            return [None] * len(spans)
        flat = compute_input_logprobs(logits[torch.cat(row_ids)], torch.cat(target_ids)).tolist()
        out: list[Optional[list[float]]] = []
        offset, it = 0, iter(counts)
        for span in spans:
            if span is None:
                out.append(None)
            else:
                rows = next(it)
                out.append(flat[offset: offset + rows])
                offset += rows
        return out

    def _input_top_logprobs(self, logits, spans, scored: list[Optional[list[float]]],
                            top_nums: list[int]) -> list[Optional[list[list[tuple[int, float]]]]]:
        """The top-k alternatives of the rows `_input_logprobs` scored, for requests that ask for k > 0 (the same
        k as their output tokens', SGLang's input_top_logprobs); one top-k over all of them, trimmed per request."""
        wanted = [values is not None and k > 0 for values, k in zip(scored, top_nums)]
        if not any(wanted):
            return [None] * len(spans)
        k_max = min(max(k for k, w in zip(top_nums, wanted) if w), self.vocab_size)
        row_ids = [torch.arange(start, start + len(values), device=logits.device)
                   for (start, _), values, w in zip(self._row_starts(spans), scored, wanted) if w]
        ids, values = compute_input_top_logprobs(logits[torch.cat(row_ids)][:, :self.vocab_size], k_max)
        ids, values = ids.tolist(), values.tolist()
        out: list[Optional[list[list[tuple[int, float]]]]] = []
        offset = 0
        for rows, k, w in zip(scored, top_nums, wanted):
            if not w:
                out.append(None)
                continue
            n = len(rows)
            out.append([list(zip(i[:k], v[:k])) for i, v in zip(ids[offset: offset + n], values[offset: offset + n])])
            offset += n
        return out


class OverlapWorker:
    """Runs batches on one background thread, in submission order, so the scheduler can prepare
    batch N+1 while batch N computes."""

    def __init__(self, worker: ModelWorker):
        self.worker = worker
        # The model thread computes with the process's thread count; the scheduler thread, on one thread
        # (run_scheduler), starts no OpenMP team of its own (common/cpu_threads.py).
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="model",
                                                              initializer=compute_threads,
                                                              initargs=(torch.get_num_threads(),))

    def launch(self, work: ModelWorkBatch) -> concurrent.futures.Future:
        self.worker.prepare(work)
        return self.executor.submit(self.worker.run, work)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True)


class BatchRunner:
    """Runs a scheduled batch: now (`run`, the normal loop) or on the model thread (`launch`, the overlap loop,
    where each request's sampled id is a future that the next batch reads on the model thread)."""

    def __init__(self, worker: ModelWorker, overlap: bool):
        self.worker = worker
        self.overlap: Optional[OverlapWorker] = OverlapWorker(worker) if overlap else None
        self.model_thread = overlap  # forwards run on the model thread, not the scheduler's

    def run(self, batch: ScheduleBatch) -> BatchResult:
        self.worker.prepare(batch.work)
        if batch.work.grammar_mask is not None:
            batch.work.grammar_mask.fill()  # the previous step's tokens are already accepted
        return self.worker.run(batch.work)

    def launch(self, batch: ScheduleBatch) -> concurrent.futures.Future:
        futures = self.worker.alloc_futures(len(batch))
        batch.work.future_indices = futures
        for req, chunked, future in zip(batch.reqs, batch.chunked, futures.tolist()):
            if not chunked:
                req.pending_future = future
        return self.overlap.launch(batch.work)

    def hidden_states(self, batch: ScheduleBatch) -> torch.Tensor:
        """Final hidden states of every token of an extend batch (embeddings); on the model thread in the overlap
        loop, after the batches launched before it, since the model and its attention metadata are not shared."""
        def forward() -> torch.Tensor:
            self.worker.prepare(batch.work)
            return self.worker.model.hidden_states(batch.work.forward_batch)
        if self.overlap is None:
            return forward()
        return self.overlap.executor.submit(forward).result()

    def shutdown(self) -> None:
        if self.overlap is not None:
            self.overlap.shutdown()


class InFlight:
    """The overlap loop's launched batches: batch N's result is processed only after batch N+1 is launched,
    so the CPU work of one step overlaps the compute of the next."""

    def __init__(self, runner: BatchRunner):
        self.runner = runner
        self._batches: deque = deque()

    def __bool__(self) -> bool:
        return bool(self._batches)

    def launch(self, batch: ScheduleBatch) -> None:
        self._batches.append((batch.snapshot(), self.runner.launch(batch)))

    def fill_grammar_mask(self) -> None:
        """Constrained rows of the newest batch may sample: call once the batch before it was processed (its
        tokens advanced every matcher). The model thread runs the forward meanwhile and waits only to sample."""
        if self._batches:
            mask = self._batches[-1][0].work.grammar_mask
            if mask is not None:
                mask.fill()

    def pop_previous(self, launched_now: bool) -> Optional[tuple[ScheduleBatch, BatchResult]]:
        """The oldest batch and its result, once a newer one runs (or nothing new was launched)."""
        if not self._batches or (launched_now and len(self._batches) == 1):
            return None
        batch, future = self._batches.popleft()
        return batch, future.result()

    def drain(self) -> Iterator[tuple[ScheduleBatch, BatchResult]]:
        """The remaining batches in order; each mask is filled after the caller processed the batch before."""
        while self._batches:
            batch, future = self._batches.popleft()
            if batch.work.grammar_mask is not None:
                batch.work.grammar_mask.fill()
            yield batch, future.result()
