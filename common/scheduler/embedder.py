"""Embedder: embedding requests as prefill-only forwards over whole prompts, pooled (last token or mean) and
L2-normalised; their KV slots are freed as soon as the forward ran (nothing is cached, nothing is sampled)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.common.errors import InvalidRequestError
from tandem.common.model.forward_batch import ForwardMode
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import EmbedOutput, EmbedRequest
from tandem.common.scheduler.kv_cache_ops import KVCacheOps
from tandem.common.scheduler.model_worker import BatchRunner
from tandem.common.scheduler.req import Req
from tandem.common.scheduler.schedule_batch import ScheduleBatch

POOLINGS = ("last", "mean")


class Embedder:
    """The embedding queue of a scheduler: `run_batch` embeds as many waiting prompts as the prefill token budget
    takes (at least one) in one forward, on the model thread in the overlap loop, and answers their futures."""

    def __init__(self, ops: KVCacheOps, runner: BatchRunner, device, pooling: str, max_tokens: int):
        if pooling not in POOLINGS:
            raise ValueError(f"embedding pooling must be one of {POOLINGS}, got {pooling!r}")
        self.ops = ops
        self.runner = runner
        self.device = device
        self.pooling = pooling
        self.max_tokens = max_tokens
        self.queue: list[EmbedRequest] = []

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, msg: EmbedRequest) -> None:
        self.queue.append(msg)

    def abort(self, rid: str) -> None:
        for msg in [m for m in self.queue if m.rid == rid]:
            msg.result.set_exception(InvalidRequestError(f"request {rid} was aborted", "request_id"))
        self.queue = [m for m in self.queue if m.rid != rid]

    def fail_all(self, message: str) -> None:
        for msg in self.queue:
            msg.result.set_exception(RuntimeError(message))
        self.queue = []

    def run_batch(self) -> None:
        """Embed the head of the queue; prompts that do not fit in the KV pool now wait for the next step."""
        if not self.queue:
            return
        take, tokens = [], 0
        for msg in self.queue:
            if take and tokens + len(msg.input_ids) > self.max_tokens:
                break
            take.append(msg)
            tokens += len(msg.input_ids)
        reqs = [self._req(m) for m in take]
        batch = ScheduleBatch(reqs, ForwardMode.EXTEND)
        if not batch.prepare_for_extend(self.ops, self.device):
            return
        self.queue = self.queue[len(take):]
        try:
            hidden = self.runner.hidden_states(batch)
        finally:
            for req in reqs:
                self.ops.release(req)
        for msg, vector in zip(take, self._pool(hidden, [len(m.input_ids) for m in take])):
            msg.result.set_result(EmbedOutput(vector.tolist(), len(msg.input_ids)))

    @staticmethod
    def _req(msg: EmbedRequest) -> Req:
        req = Req(msg.rid, 0, msg.input_ids, SamplingParams(max_new_tokens=0), set())
        req.fill_ids = list(msg.input_ids)
        req.extend_input_len = len(msg.input_ids)
        return req

    def _pool(self, hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        rows = torch.split(hidden, lengths)
        pooled = torch.stack([r[-1] if self.pooling == "last" else r.mean(0) for r in rows])
        return F.normalize(pooled, p=2, dim=-1).cpu()
