"""DecodeGraphRunner: the decode forward captured once per batch-size bucket (torch.compile on CPU, CUDA graphs on
CUDA), each batch padded to its bucket, in the spirit of SGLang's CudaGraphRunner and mini-sglang's graph.py."""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import replace
from typing import Optional

import torch
from tqdm import tqdm

from tandem.common.model.attention.compiled import attention_context
from tandem.common.model.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

# KV slot of every padded row: slot 0 lies in the pool's padding page, which the allocator never hands out, so a
# padded row's K/V write lands where no request reads.
SCRATCH_SLOT = 0


# The per-request tensors of a decode batch that `pad` grows to the bucket.
BATCH_TENSORS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "extend_prefix_lens",
                 "extend_seq_lens")


class DecodeGraphRunner:
    """Runs decode batches of up to max(batch_sizes) requests through a forward captured for their bucket.

    A batch of B requests runs in the smallest bucket >= B: the B - bucket padded rows decode token 0 at position 0
    into SCRATCH_SLOT, attending to one key of the first request (read only), and their logits are dropped. `pad`
    runs where the batch is planned (the scheduler thread), `forward` where it runs (possibly the model thread).
    """

    def __init__(self, model, req_to_token_pool, kv_pool, batch_sizes: list[int], device: torch.device):
        self.model = model
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        self.device = torch.device(device)
        self._graphs: dict[int, _CudaGraph] = {}
        self.replays = 0  # batches run through a graph (capture excluded)
        if self.device.type == "cuda":
            self._forward = self.model.forward
        else:
            # One compiled artefact per bucket: dynamic=False specializes every shape, so each bucket is its own
            # fully static graph; the recompile limit must let every bucket in.
            limit = len(self.batch_sizes) + 8
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
            # Traced outside inference mode (AOTAutograd cannot functionalize views of inference tensors), hence
            # the forward without its inference_mode decorator, run under no_grad.
            eager = type(self.model).forward.__wrapped__
            self._forward = torch.compile(lambda fb: eager(self.model, fb), backend="inductor", dynamic=False,
                                          fullgraph=True)

    def bucket_for(self, batch_size: int) -> Optional[int]:
        """The smallest captured batch size >= batch_size, or None when the batch is larger than every bucket."""
        i = bisect.bisect_left(self.batch_sizes, batch_size)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def pad(self, fb: ForwardBatch) -> Optional[ForwardBatch]:
        """A copy of a decode batch padded to its bucket, or None when the graphs cannot run it (extend, input
        logprobs, or more requests than the largest bucket)."""
        if not fb.is_decode or fb.logits_indices is not None:
            return None
        bucket = self.bucket_for(fb.batch_size)
        if bucket is None:
            return None
        n = bucket - fb.batch_size
        if n == 0:
            return self._as_inference(replace(fb))

        def grow(t: torch.Tensor, value) -> torch.Tensor:
            fill = t[:1].expand(n) if value is None else torch.full((n,), value, dtype=t.dtype, device=t.device)
            return torch.cat([t, fill])

        return self._as_inference(replace(
            fb, batch_size=bucket, input_ids=grow(fb.input_ids, 0), positions=grow(fb.positions, 0),
            out_cache_loc=grow(fb.out_cache_loc, SCRATCH_SLOT), req_pool_indices=grow(fb.req_pool_indices, None),
            seq_lens=grow(fb.seq_lens, 1), extend_prefix_lens=grow(fb.extend_prefix_lens, 0),
            extend_seq_lens=grow(fb.extend_seq_lens, 1), seq_lens_cpu=fb.seq_lens_cpu + [1] * n,
            extend_prefix_lens_cpu=fb.extend_prefix_lens_cpu + [0] * n,
            extend_seq_lens_cpu=fb.extend_seq_lens_cpu + [1] * n, attn_metadata=None))

    def _as_inference(self, fb: ForwardBatch) -> ForwardBatch:
        """On CPU, the batch's index tensors as inference tensors: a compiled bucket guards on its inputs' dispatch
        keys, and the scheduler builds some of them inside inference mode and some outside, which would compile
        each bucket again (past the recompile limit). Plain ones are copied (at most max_bs ids each)."""
        if self.device.type == "cuda":
            return fb
        plain = [name for name in BATCH_TENSORS if not getattr(fb, name).is_inference()]
        if not plain:
            return fb
        with torch.inference_mode():
            return replace(fb, **{name: getattr(fb, name).clone() for name in plain})

    def forward(self, padded: ForwardBatch, real_rows: Optional[int] = None) -> torch.Tensor:
        """float32 logits [bucket, vocab] of a batch from `pad` whose attention plan is built; its first
        `real_rows` rows are requests (default: all), the rest padding."""
        self.replays += 1
        recorder = getattr(self.model, "expert_recorder", None)
        if recorder is None:
            return self._run(padded)
        # An MoE model counts its routing inside the graph: the real rows only, and the pass ends after it.
        with recorder.rows(real_rows or padded.batch_size):
            logits = self._run(padded)
        recorder.end_pass()
        return logits

    def _run(self, padded: ForwardBatch) -> torch.Tensor:
        if self.device.type == "cuda":
            with torch.inference_mode():
                return self._graphs[padded.batch_size].replay(padded)
        with torch.inference_mode(False), torch.no_grad(), attention_context(self.model.attn_backend, padded):
            return self._forward(padded)

    def capture(self) -> float:
        """Compile or capture every bucket now (a dummy batch of padded rows each), with a progress bar; returns
        the seconds it took."""
        start = time.perf_counter()
        if self.device.type == "cuda":
            self.model.attn_backend.init_graph_state(self.max_bs, self.req_to_token_pool.max_context_len)
        for bs in tqdm(self.batch_sizes, desc="capturing decode graphs", unit="bucket", leave=False):
            fb = self._dummy_batch(bs)
            if self.device.type == "cuda":
                self._graphs[bs] = _CudaGraph(self.model, fb)
            else:
                self.model.attn_backend.init_forward_metadata(fb)
                self.forward(fb)
                self.replays -= 1
        elapsed = time.perf_counter() - start
        kind = "CUDA graphs" if self.device.type == "cuda" else "torch.compile (inductor)"
        logger.info("decode graphs ready: %s for batch sizes %s in %.1f s", kind, self.batch_sizes, elapsed)
        return elapsed

    def _dummy_batch(self, bs: int) -> ForwardBatch:
        def full(value: int) -> torch.Tensor:
            # Inference tensors, as the scheduler's batches are: a compiled bucket guards on the inputs' dispatch
            # keys, and a capture on plain tensors would be compiled again by the first real batch (twice the
            # compiles, past the recompile limit with the default buckets).
            with torch.inference_mode():
                return torch.full((bs,), value, dtype=torch.int64, device=self.device)

        return ForwardBatch(
            mode=ForwardMode.DECODE, batch_size=bs, input_ids=full(0), positions=full(0),
            out_cache_loc=full(SCRATCH_SLOT), req_pool_indices=full(0), seq_lens=full(1),
            extend_prefix_lens=full(0), extend_seq_lens=full(1), req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.kv_pool, seq_lens_cpu=[1] * bs, extend_prefix_lens_cpu=[0] * bs,
            extend_seq_lens_cpu=[1] * bs)


class _CudaGraph:
    """One bucket's CUDA graph over static buffers: the inputs, copied in before every replay, and the attention
    plan the backend captured it on (init_graph_metadata), which the backend points at each batch before its
    replay (replay_graph_metadata): the torch backend's [B, context] indices and mask, FlashInfer's planned
    wrapper; the triton backend has none, its kernels read the batch tensors and the pool."""

    def __init__(self, model, fb: ForwardBatch):
        self.model = model
        backend = model.attn_backend
        ctx = fb.req_to_token_pool.max_context_len
        self.static = replace(fb, seq_lens_cpu=[ctx] * fb.batch_size)  # plan for the longest sequence
        backend.init_graph_metadata(self.static)
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (allocator, cuBLAS workspaces)
                model.forward(self.static)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = model.forward(self.static)

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        static = self.static
        for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens"):
            getattr(static, name).copy_(getattr(fb, name))
        self.model.attn_backend.replay_graph_metadata(static, fb)
        self.graph.replay()
        return self.logits
