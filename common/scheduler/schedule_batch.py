"""ScheduleBatch: the requests of one forward step, and the tensors the model worker needs for it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

import torch

from tandem.common.model.forward_batch import ForwardBatch, ForwardMode, mix_batches
from tandem.common.sampling.grammar import GrammarMask
from tandem.common.scheduler.kv_cache_ops import KVCacheOps
from tandem.common.scheduler.req import Req


@dataclass
class ModelWorkBatch:
    """Everything the model worker needs for one step, snapshotted so the scheduler may move on."""

    forward_batch: ForwardBatch
    sampling_params: list
    prompt_ids: list[list[int]]
    output_ids: list[list[int]]  # snapshot; overlap: the pending future token is appended by the worker
    pending_futures: list[Optional[int]]
    seeds: list[Optional[int]]
    sample_positions: list[int]  # per req: the position of the token it samples this step
    stop_ids: list[set[int]]
    return_logprob: list[bool]
    top_logprobs_num: list[int]
    input_logprob_spans: list[Optional[tuple[int, int]]]  # per req: (rows, next prompt token or -1)
    future_indices: Optional[torch.Tensor] = None  # where the worker stores the sampled ids
    lora: list = field(default_factory=list)  # per req: its LoRAAdapter or None
    graph_batch: Optional[ForwardBatch] = None  # forward_batch padded to a decode graph's bucket, when one runs it
    # Constrained rows' allowed tokens, filled by the scheduler once the previous step's tokens are accepted.
    grammar_mask: Optional[GrammarMask] = None
    decode_rows: int = 0  # mixed chunk: the last rows are running requests' decode steps

    def mixed_with(self, decode: "ModelWorkBatch") -> "ModelWorkBatch":
        """This extend's work followed by a decode batch's, as one forward (per-request lists concatenated)."""
        rows = {f.name: getattr(self, f.name) + getattr(decode, f.name)
                for f in fields(self) if isinstance(getattr(self, f.name), list)}
        grammars = [*_grammars(self), *_grammars(decode)]
        return ModelWorkBatch(forward_batch=mix_batches(self.forward_batch, decode.forward_batch),
                              grammar_mask=GrammarMask.of(grammars), decode_rows=len(decode.sampling_params), **rows)


def _grammars(work: ModelWorkBatch) -> list:
    return work.grammar_mask.grammars if work.grammar_mask is not None else [None] * len(work.sampling_params)


@dataclass
class BatchResult:
    next_token_ids: list[int]
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None
    input_logprobs: list[Optional[list[float]]] = field(default_factory=list)
    # Per request, its scored rows' top-k alternatives (None where none were asked for), row for row as above.
    input_top_logprobs: list[Optional[list[list[tuple[int, float]]]]] = field(default_factory=list)


class ScheduleBatch:
    """A list of requests plus the step they take together (extend or decode)."""

    def __init__(self, reqs: list[Req], mode: ForwardMode):
        self.reqs = reqs
        self.mode = mode
        self.epochs = [r.epoch for r in reqs]
        # Whether each request's extend is an intermediate chunk, frozen now: in the overlap loop the
        # request's own flag moves on to its next chunk before this batch's result is processed.
        self.chunked = [r.is_chunked for r in reqs]
        self.work: Optional[ModelWorkBatch] = None
        # --enable-mixed-chunk: this many last rows are running requests' decode steps, run in this extend's
        # forward (SGLang's mix_with_running); the rows before them are the prefill.
        self.decode_rows = 0

    def __len__(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    def snapshot(self) -> "ScheduleBatch":
        """A frozen copy for result processing in the overlap loop."""
        copy = ScheduleBatch(list(self.reqs), self.mode)
        copy.epochs, copy.chunked = list(self.epochs), list(self.chunked)
        copy.work, copy.decode_rows = self.work, self.decode_rows
        return copy

    def filter(self, keep) -> None:
        first_decode = len(self.reqs) - self.decode_rows
        rows = [(i, r, e, c) for i, (r, e, c) in enumerate(zip(self.reqs, self.epochs, self.chunked)) if keep(r)]
        self.reqs = [r for _, r, _, _ in rows]
        self.epochs = [e for _, _, e, _ in rows]
        self.chunked = [c for _, _, _, c in rows]
        self.decode_rows = sum(1 for i, _, _, _ in rows if i >= first_decode)

    def is_prefill_row(self, i: int) -> bool:
        """Row i extends a prompt (not a running request's decode step mixed into the batch)."""
        return self.mode is ForwardMode.EXTEND and i < len(self.reqs) - self.decode_rows

    def prefill_part(self) -> "ScheduleBatch":
        """This batch without its mixed-in decode rows (the requests it prefilled)."""
        if not self.decode_rows:
            return self
        n = len(self.reqs) - self.decode_rows
        part = ScheduleBatch(self.reqs[:n], self.mode)
        part.epochs, part.chunked, part.work = self.epochs[:n], self.chunked[:n], self.work
        return part

    def mix(self, decode: "ScheduleBatch") -> None:
        """Run the running requests' next decode step (`decode`, prepared) in this prepared extend's forward."""
        self.reqs = self.reqs + decode.reqs
        self.epochs = self.epochs + decode.epochs
        self.chunked = self.chunked + [False] * len(decode.reqs)
        self.decode_rows = len(decode.reqs)
        self.work = self.work.mixed_with(decode.work)

    def merge(self, other: "ScheduleBatch") -> None:
        self.reqs.extend(other.reqs)
        self.epochs.extend(other.epochs)
        self.chunked.extend([False] * len(other.reqs))

    # ---- building the model inputs -------------------------------------------------------------

    def prepare_for_extend(self, ops: KVCacheOps, device) -> bool:
        """Allocate slots for the new tokens of every request and build the extend inputs.
        Returns False (allocating nothing) if the pool cannot hold them."""
        allocated = self.alloc_extend(ops)
        if allocated is None:
            return False
        prefix_lens, seq_lens, out_cache_loc = allocated
        input_ids, positions = [], []
        for r, p, s in zip(self.reqs, prefix_lens, seq_lens):
            input_ids.extend(r.fill_ids[p:s])
            positions.extend(range(p, s))
        extend_lens = [s - p for s, p in zip(seq_lens, prefix_lens)]
        fb = self._forward_batch(ForwardMode.EXTEND, input_ids, positions, out_cache_loc, seq_lens,
                                 prefix_lens, extend_lens, ops, device)
        self.work = self._work(fb, extend_lens, prefix_lens)
        return True

    def alloc_extend(self, ops: KVCacheOps) -> Optional[tuple[list[int], list[int], torch.Tensor]]:
        """Give every request a req slot and KV slots for its new tokens, written into req_to_token, and
        advance kv_len: (prefix_lens, seq_lens, out_cache_loc), or None, allocating nothing, when out of room.
        The decode worker calls this alone to reserve a prompt's pages for its transfer."""
        pool = ops.req_to_token_pool
        # A request continuing a chunked prefill extends from its own KV; a new one from its cached prefix.
        prefix_lens = [r.kv_len if r.req_pool_idx is not None else len(r.prefix_indices) for r in self.reqs]
        seq_lens = [p + r.extend_input_len for p, r in zip(prefix_lens, self.reqs)]
        new_reqs = [r for r in self.reqs if r.req_pool_idx is None]
        if pool.available_size() < len(new_reqs):
            return None
        for r, p in zip(self.reqs, prefix_lens):
            if r.req_pool_idx is None:
                r.req_pool_idx = pool.alloc()
                if p:
                    pool.req_to_token[r.req_pool_idx, :p] = r.prefix_indices
        rows = torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64, device=pool.device)
        cols = torch.tensor([max(p - 1, 0) for p in prefix_lens], dtype=torch.int64, device=pool.device)
        has_prefix = torch.tensor([p > 0 for p in prefix_lens], device=pool.device)
        last_locs = torch.where(has_prefix, pool.req_to_token[rows, cols], -1)  # one gather, not one read each
        need = sum(s - p for s, p in zip(seq_lens, prefix_lens))
        ops.evict_for(need + ops.page_size * len(self.reqs))
        out_cache_loc = ops.allocator.alloc_extend(prefix_lens, seq_lens, last_locs)
        if out_cache_loc is None:
            for r in new_reqs:
                pool.free(r.req_pool_idx)
                r.req_pool_idx = None
            return None
        offset = 0
        for r, p, s in zip(self.reqs, prefix_lens, seq_lens):
            pool.req_to_token[r.req_pool_idx, p:s] = out_cache_loc[offset: offset + s - p]
            offset += s - p
            r.kv_len = s
        return prefix_lens, seq_lens, out_cache_loc

    def prepare_for_decode(self, ops: KVCacheOps, device) -> bool:
        pool = ops.req_to_token_pool
        positions = [r.kv_len for r in self.reqs]
        seq_lens = [p + 1 for p in positions]
        idx = torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64, device=pool.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=pool.device)
        # Stays a tensor: no device-to-host round trip for the slots before the new tokens.
        last_locs = pool.req_to_token[idx, pos - 1]
        out_cache_loc = ops.allocator.alloc_decode(seq_lens, last_locs)
        if out_cache_loc is None:
            return False
        pool.req_to_token[idx, pos] = out_cache_loc
        input_ids = []
        for r in self.reqs:
            input_ids.append(-r.pending_future if r.pending_future is not None else r.output_ids[-1])
            r.kv_len += 1
        ones = [1] * len(self.reqs)
        fb = self._forward_batch(ForwardMode.DECODE, input_ids, positions, out_cache_loc, seq_lens,
                                 positions, ones, ops, device)
        self.work = self._work(fb, ones, positions)
        return True

    def _forward_batch(self, mode, input_ids, positions, out_cache_loc, seq_lens, prefix_lens,
                       extend_lens, ops: KVCacheOps, device) -> ForwardBatch:
        def t(values):
            return torch.tensor(values, dtype=torch.int64, device=device)

        return ForwardBatch(
            mode=mode, batch_size=len(self.reqs), input_ids=t(input_ids), positions=t(positions),
            out_cache_loc=out_cache_loc.to(device), req_pool_indices=t([r.req_pool_idx for r in self.reqs]),
            seq_lens=t(seq_lens), extend_prefix_lens=t(prefix_lens), extend_seq_lens=t(extend_lens),
            req_to_token_pool=ops.req_to_token_pool, token_to_kv_pool=None,  # the worker fills it
            seq_lens_cpu=list(seq_lens), extend_prefix_lens_cpu=list(prefix_lens),
            extend_seq_lens_cpu=list(extend_lens),
        )

    def _work(self, fb: ForwardBatch, extend_lens: list[int], prefix_lens: list[int]) -> ModelWorkBatch:
        spans: list[Optional[tuple[int, int]]] = []
        logits_rows: list[int] = []
        row = 0
        for r, n, p in zip(self.reqs, extend_lens, prefix_lens):
            wants_input = (fb.mode is ForwardMode.EXTEND and r.return_logprob and r.logprob_start_len >= 0)
            if wants_input:
                # All rows of this extend; the last one scores the next prompt token if one follows.
                seq_len = p + n
                next_input = r.origin_input_ids[seq_len] if seq_len < len(r.origin_input_ids) else -1
                spans.append((n, next_input))
                logits_rows.extend(range(row, row + n))
            else:
                spans.append(None)
                logits_rows.append(row + n - 1)
            row += n
        if any(s is not None for s in spans):
            fb.logits_indices = torch.tensor(logits_rows, dtype=torch.int64, device=fb.input_ids.device)
        return ModelWorkBatch(
            forward_batch=fb,
            sampling_params=[r.sampling_params for r in self.reqs],
            prompt_ids=[r.origin_input_ids for r in self.reqs],
            output_ids=[r.generated_ids() if _needs_history(r) else [] for r in self.reqs],
            pending_futures=[r.pending_future for r in self.reqs],
            seeds=[None if r.is_chunked else r.seed for r in self.reqs],
            sample_positions=[p + n for n, p in zip(extend_lens, prefix_lens)],
            # An intermediate chunk's sampled token is thrown away: its row stays unconstrained.
            grammar_mask=GrammarMask.of([None if r.is_chunked else r.grammar for r in self.reqs]),
            stop_ids=[r.stop_ids for r in self.reqs],
            return_logprob=[r.return_logprob for r in self.reqs],
            top_logprobs_num=[r.top_logprobs_num for r in self.reqs],
            input_logprob_spans=spans,
            lora=[r.lora for r in self.reqs],
        )


def _needs_history(req: Req) -> bool:
    """Only penalties and min_new_tokens read past output tokens; skip the copy otherwise."""
    p = req.sampling_params
    return p.has_penalties or p.min_new_tokens > 0
