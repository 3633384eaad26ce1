"""Engine load figures for gateways: one snapshot feeds GetLoads and the load records on KV-event streams."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tandem.common.roles import Role

GB = 1024**3


@dataclass
class LoadSnapshot:
    running: int
    waiting: int
    used_tokens: int  # KV tokens held by requests (not counting evictable prefix cache)
    cached_tokens: int  # KV tokens held by the prefix cache only
    total_tokens: int
    token_usage: float
    active_token_usage: float
    cache_hit_rate: float
    gen_throughput: float
    max_running_requests: int
    waiting_prompt_tokens: int
    weight_gb: float
    kv_cache_gb: float
    queues: dict = field(default_factory=dict)
    taken_at: float = field(default_factory=time.monotonic)


def read_scheduler(s) -> dict:
    """The raw figures; runs on the scheduler thread (through Engine.call) so they are consistent."""
    tree = s.ops.tree_cache
    running, waiting = s.load()
    return {
        "running": running, "waiting": waiting, "queues": s.queue_sizes(),
        "free": s.ops.allocator.available_size(), "evictable": tree.evictable_size() if s.ops.caching else 0,
        "hit": getattr(tree, "hit_tokens", 0), "queried": getattr(tree, "queried_tokens", 0),
        "generated": s.outputs.counters.generation_tokens,
        "waiting_prompt_tokens": sum(len(r.origin_input_ids) for r in s.batcher.waiting_queue),
    }


class LoadSampler:
    """Turns raw engine figures into a LoadSnapshot; tracks generated tokens over time for throughput."""

    def __init__(self, engine):
        self.engine = engine
        self.total_tokens = engine.max_total_tokens
        from tandem.common.model.quant.base import weight_bytes  # torch: a DP controller imports this module

        self.weight_gb = weight_bytes(engine.model) / GB
        self.kv_cache_gb = engine.kv_pool.total_bytes() / GB
        self._lock = threading.Lock()
        self._last = (time.monotonic(), 0)
        self._throughput = 0.0

    def sample(self) -> LoadSnapshot:
        return self.from_raw(self.engine.call(read_scheduler))

    def from_raw(self, raw: dict) -> LoadSnapshot:
        now = time.monotonic()
        with self._lock:
            then, generated = self._last
            if now - then >= 0.5:
                self._throughput = max(raw["generated"] - generated, 0) / (now - then)
                self._last = (now, raw["generated"])
        used = self.total_tokens - raw["free"] - raw["evictable"]
        return LoadSnapshot(
            running=raw["running"], waiting=raw["waiting"], used_tokens=used, cached_tokens=raw["evictable"],
            total_tokens=self.total_tokens,
            token_usage=(self.total_tokens - raw["free"]) / self.total_tokens,
            active_token_usage=used / self.total_tokens,
            cache_hit_rate=raw["hit"] / raw["queried"] if raw["queried"] else 0.0,
            gen_throughput=self._throughput,
            max_running_requests=self.engine.config.max_running_requests,
            waiting_prompt_tokens=raw["waiting_prompt_tokens"],
            weight_gb=self.weight_gb, kv_cache_gb=self.kv_cache_gb, queues=raw["queues"],
        )


def scheduler_load(snap: LoadSnapshot, role: str, sections: set[str]) -> pb.SchedulerLoad:
    """GetLoads' per-rank record; `sections` from GetLoadsRequest.include (empty = core only, "all" = all)."""
    load = pb.SchedulerLoad(
        dp_rank=0, num_running_reqs=snap.running, num_waiting_reqs=snap.waiting,
        num_total_reqs=snap.running + snap.waiting, num_used_tokens=snap.used_tokens,
        max_total_num_tokens=snap.total_tokens, token_usage=snap.token_usage,
        gen_throughput=snap.gen_throughput, cache_hit_rate=snap.cache_hit_rate,
        utilization=snap.running / snap.max_running_requests, max_running_requests=snap.max_running_requests,
        num_waiting_uncached_tokens=snap.waiting_prompt_tokens)
    want = (lambda name: "all" in sections or name in sections)
    if want("memory"):
        load.memory.CopyFrom(pb.MemoryMetrics(weight_gb=snap.weight_gb, kv_cache_gb=snap.kv_cache_gb,
                                              token_capacity=snap.total_tokens))
    if want("disagg"):
        load.disaggregation.CopyFrom(pb.DisaggregationMetrics(**disagg_fields(snap, role)))
    if want("queues"):
        load.queues.CopyFrom(pb.QueueMetrics(waiting=snap.waiting))
    return load


def disagg_fields(snap: LoadSnapshot, role: str) -> dict:
    q = snap.queues
    return dict(mode=Role(role).disaggregation_mode,
                prefill_prealloc_queue_reqs=q.get("bootstrap", 0), prefill_inflight_queue_reqs=q.get("inflight", 0),
                decode_prealloc_queue_reqs=q.get("prealloc", 0), decode_transfer_queue_reqs=q.get("transfer", 0))


def aggregate(snap: LoadSnapshot) -> pb.AggregateMetrics:
    return pb.AggregateMetrics(
        total_running_reqs=snap.running, total_waiting_reqs=snap.waiting, total_reqs=snap.running + snap.waiting,
        avg_token_usage=snap.token_usage, avg_throughput=snap.gen_throughput,
        avg_utilization=snap.running / snap.max_running_requests)


def engine_load(snap: LoadSnapshot, role: str, sample: int, load_only: bool, full: bool) -> common_pb2.EngineLoad:
    """The load record carried on KvEventBatch; `full` adds the telemetry beyond the routing core."""
    load = common_pb2.EngineLoad(
        running_requests=snap.running, waiting_requests=snap.waiting,
        waiting_uncached_tokens=snap.waiting_prompt_tokens, token_usage=snap.token_usage,
        active_token_usage=snap.active_token_usage, gen_throughput=snap.gen_throughput,
        max_running_requests=snap.max_running_requests,
        age_ms=int((time.monotonic() - snap.taken_at) * 1000), sample=sample, load_only=load_only)
    if full:
        load.cache_hit_rate = snap.cache_hit_rate
        load.num_used_tokens = snap.used_tokens
        load.max_total_num_tokens = snap.total_tokens
        load.memory.CopyFrom(common_pb2.EngineMemory(weight_gb=snap.weight_gb, kv_cache_gb=snap.kv_cache_gb,
                                                     token_capacity=snap.total_tokens))
        load.queues.CopyFrom(common_pb2.EngineQueues(waiting=snap.waiting))
        load.disaggregation.CopyFrom(common_pb2.EngineDisaggregation(**disagg_fields(snap, role)))
    return load
