"""FlashInferAttentionBackend: FlashInfer's paged prefill and decode kernels (CUDA only), used as SGLang's flashinfer
backend uses them.

The pool is read as pages of one token: a request's KV indices are its req_to_token row, so any --page-size works
and a radix-shared prefix is read where it lies. Each batch is planned once (FlashInfer's `plan`: the split of the
work over the GPU, computed on the host) and every layer runs the planned kernels.

Where the plan runs: `init_forward_metadata` runs on the scheduler thread, which in the overlap loop plans batch N+1
while the model thread still runs batch N. A wrapper's plan lives in the wrapper (its buffers and host copies), so
planning there would change the plan under a running batch. The scheduler thread therefore only gathers the index
tensors, and the wrapper is planned by the batch's first layer on the model thread (or, for a decode graph, right
before the replay), where forwards run one after another.

Decode graphs: one wrapper per batch-size bucket, built with `use_cuda_graph=True` over static index buffers that
every bucket shares (one graph replays at a time); a replay re-plans that wrapper with the batch's indices.
"""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import dataclass, field

import torch

from tandem.common.model.attention.base import AttentionBackend
from tandem.common.model.forward_batch import ForwardBatch

# FlashInfer's scratch for split-KV partial results (SGLang's default size); shared by every wrapper, which run one
# at a time on one stream.
WORKSPACE_BYTES = 128 << 20

# Decode runs FlashInfer's prefill kernels (tensor cores) once this many query heads share a KV head, as SGLang
# decides; below it the CUDA-core decode kernel is faster.
TENSOR_CORE_MIN_GROUP = 4

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def flashinfer_unavailable_reason(device: torch.device | str) -> str | None:
    """Why --attention-backend flashinfer cannot run on `device` in this process, or None when it can."""
    device = torch.device(device)
    if device.type != "cuda":
        return (f"--attention-backend flashinfer runs FlashInfer's CUDA kernels, on --device cuda only, not "
                f"{device.type}; on CPU use cpu (the default) or torch")
    if importlib.util.find_spec("flashinfer") is None:
        return ("--attention-backend flashinfer needs the flashinfer-python package (pip install flashinfer-python; "
                "its kernels compile with nvcc on first use)")
    return None


@dataclass
class FlashInferMetadata:
    """One batch's plan inputs: host indptrs (FlashInfer plans on the host) and the KV indices on the device.

    kv_indptr [B+1] / qo_indptr [B+1] (EXTEND only): int32 on the host; kv_indices [sum(seq_lens)]: int32 KV
    slots of every request's sequence, request after request. `wrapper` is planned with them on first use.
    """

    wrapper: object
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    qo_indptr: torch.Tensor | None = None
    planned: bool = False
    last_page_len: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.last_page_len = torch.ones(self.kv_indptr.numel() - 1, dtype=torch.int32)  # every page is one token


class FlashInferAttentionBackend(AttentionBackend):
    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        reason = flashinfer_unavailable_reason(self.device)
        if reason:
            raise ValueError(reason)
        import flashinfer  # optional: only --attention-backend flashinfer (CUDA) needs it

        self._flashinfer = flashinfer
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self.decode = None  # built by configure(), which knows whether decode runs on tensor cores
        self.shape: tuple[int, int, int] | None = None  # (query heads, KV heads, head dim) of this rank
        self.dtype: torch.dtype | None = None
        self._graph_wrappers: dict[int, object] = {}
        self._graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def configure(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        if dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"--attention-backend flashinfer runs float16 or bfloat16 (FlashInfer's kernels), not "
                             f"{str(dtype).removeprefix('torch.')}: pass --dtype bfloat16, or use triton")
        self.shape, self.dtype = (num_heads, num_kv_heads, head_dim), dtype
        self.tensor_cores = num_heads // num_kv_heads >= TENSOR_CORE_MIN_GROUP
        self.decode = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.tensor_cores, backend="fa2")

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        self._check_configured()
        if fb.token_to_kv_pool.quantized:  # EngineConfig refuses it at start-up; a pool built by hand lands here
            raise ValueError("--attention-backend flashinfer does not read an FP8 KV pool in Tandem (not verified "
                             "without a GPU); use --attention-backend triton with --kv-cache-dtype fp8")
        kv_indptr, kv_indices = _kv_layout(fb)
        if fb.is_decode:
            fb.attn_metadata = FlashInferMetadata(self.decode, kv_indptr, kv_indices)
        else:
            qo_indptr = _indptr(fb.extend_seq_lens_cpu)
            fb.attn_metadata = FlashInferMetadata(self.prefill, kv_indptr, kv_indices, qo_indptr)

    def init_graph_state(self, max_batch_size: int, max_context_len: int) -> None:
        device = self.device
        self._graph_buffers = (torch.zeros(max_batch_size + 1, dtype=torch.int32, device=device),
                               torch.zeros(max_batch_size * max_context_len, dtype=torch.int32, device=device),
                               torch.ones(max_batch_size, dtype=torch.int32, device=device))

    def init_graph_metadata(self, fb: ForwardBatch) -> None:
        self._check_configured()
        if self._graph_buffers is None:
            raise RuntimeError("init_graph_state must run before a decode graph is captured")
        indptr, indices, last_page_len = self._graph_buffers
        bs = fb.batch_size
        wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.tensor_cores,
            paged_kv_indptr_buffer=indptr[: bs + 1], paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last_page_len[:bs], backend="fa2")
        self._graph_wrappers[bs] = wrapper
        kv_indptr, kv_indices = _kv_layout(fb)
        meta = FlashInferMetadata(wrapper, kv_indptr, kv_indices)
        self._plan(meta)  # capture is outside the graph: plan now, as a replay does right before it runs
        fb.attn_metadata = meta

    def replay_graph_metadata(self, static: ForwardBatch, fb: ForwardBatch) -> None:
        planned: FlashInferMetadata = fb.attn_metadata
        meta = FlashInferMetadata(self._graph_wrappers[static.batch_size], planned.kv_indptr, planned.kv_indices)
        self._plan(meta)
        static.attn_metadata = meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer_id, fb.out_cache_loc, k, v)
        meta: FlashInferMetadata = fb.attn_metadata
        if not meta.planned:
            self._plan(meta)
        k_buf, v_buf = pool.get_kv_buffer(layer_id)
        num_tokens, num_heads, head_dim = q.shape
        queries = q.to(k_buf.dtype).contiguous()
        # [slots, Hkv, D] as [pages, 1 token, Hkv, D]: FlashInfer's NHD paged layout, without a copy.
        out = meta.wrapper.run(queries, (k_buf.unsqueeze(1), v_buf.unsqueeze(1)))
        return out.view(num_tokens, num_heads * head_dim).to(q.dtype)

    def _plan(self, meta: FlashInferMetadata) -> None:
        num_heads, num_kv_heads, head_dim = self.shape
        kwargs = dict(q_data_type=self.dtype, kv_data_type=self.dtype)
        if meta.qo_indptr is None:
            meta.wrapper.plan(meta.kv_indptr, meta.kv_indices, meta.last_page_len, num_heads, num_kv_heads,
                              head_dim, 1, **kwargs)
        else:
            meta.wrapper.plan(meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.last_page_len, num_heads,
                              num_kv_heads, head_dim, 1, causal=True, **kwargs)
        meta.planned = True

    def _check_configured(self) -> None:
        if self.shape is None:
            raise RuntimeError("FlashInferAttentionBackend.configure (the model's heads and dtype) was not called")


def _indptr(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _kv_layout(fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_indptr on the host, kv_indices on the device): each request's KV slots req_to_token[row, :seq_len], one
    request after another, gathered on the device without a sync (the total comes from the host lengths)."""
    seq_lens_cpu = fb.seq_lens_cpu
    kv_indptr = _indptr(seq_lens_cpu)
    total = int(kv_indptr[-1])
    req_to_token = fb.req_to_token_pool.req_to_token
    device = req_to_token.device
    # From the host lengths, not fb.seq_lens: a graph is captured on a batch planned for its longest context.
    seq_lens = torch.tensor(seq_lens_cpu, dtype=torch.int64).to(device, non_blocking=True)
    rows = fb.req_pool_indices.to(device, non_blocking=True)
    request_of = torch.repeat_interleave(torch.arange(fb.batch_size, device=device), seq_lens, output_size=total)
    starts = torch.cumsum(seq_lens, 0) - seq_lens
    positions = torch.arange(total, device=device) - starts[request_of]
    return kv_indptr, req_to_token[rows[request_of], positions].to(torch.int32)
