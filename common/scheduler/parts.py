"""What the Engine hands a scheduler (SchedulerParts: the loaded model and memory, where outputs go, metrics) and
what it expects back (SchedulerProtocol: the unified, prefill and decode schedulers all provide it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from tandem.common.config import EngineConfig
from tandem.common.memory.kv_pool import MHATokenToKVPool
from tandem.common.sampling.grammar import GrammarBackend
from tandem.common.scheduler.batcher import Batcher
from tandem.common.scheduler.kv_cache_ops import KVCacheOps
from tandem.common.scheduler.loop import Inbox
from tandem.common.scheduler.model_worker import BatchRunner, ModelWorker
from tandem.common.scheduler.output import OutputProcessor, OutputSink
from tandem.common.scheduler.sessions import SessionPins
from tandem.common.telemetry.metrics import WorkerMetrics


@dataclass
class SchedulerParts:
    config: EngineConfig
    worker: ModelWorker  # the model and sampler
    ops: KVCacheOps  # request slots, KV pages and the tree cache
    kv_pool: MHATokenToKVPool  # the K/V buffers (a KV transfer registers them)
    eos_token_ids: set[int]
    max_context_len: int
    sink: OutputSink  # receives every TokenOutput, on the scheduler thread
    metrics: WorkerMetrics  # WorkerMetrics.off(role) when nothing serves them
    grammar: Optional[GrammarBackend] = None  # compiles constraints; None when the model has no tokenizer
    # Tensor parallelism: rank 0's runner (it reaches the other ranks), this rank's global KV heads and the model's
    # KV head count; a KV transfer describes every rank's pool shard with them. None / 0: one process, every head.
    tp_runner: Optional[object] = None
    kv_heads: Optional[range] = None
    total_kv_heads: int = 0


class SchedulerProtocol(Protocol):
    """A scheduler as the Engine and the scheduler thread (loop.run_scheduler) use it."""

    inbox: Inbox
    ops: KVCacheOps
    batcher: Batcher
    outputs: OutputProcessor
    runner: BatchRunner
    sessions: SessionPins
    crash: Optional[BaseException]

    def event_loop_normal(self) -> None: ...
    def event_loop_overlap(self) -> None: ...
    def fail_everything(self, message: str) -> None: ...
    def queue_sizes(self) -> dict: ...
    def load(self) -> tuple[int, int]: ...
    def close(self) -> None: ...
