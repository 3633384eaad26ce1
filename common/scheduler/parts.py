"""SchedulerParts: what the Engine hands a scheduler — the loaded model and memory, where outputs go, and metrics."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import EngineConfig
from common.memory.kv_pool import MHATokenToKVPool
from common.scheduler.kv_cache_ops import KVCacheOps
from common.scheduler.model_worker import ModelWorker
from common.scheduler.output import OutputSink
from common.telemetry.metrics import WorkerMetrics


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
