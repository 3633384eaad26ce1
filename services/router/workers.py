"""The worker registry: static and DNS-discovered workers, health checks, circuit breakers, load polling and
KV-event subscriptions. It only observes workers; dispatch.py sends them requests."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tandem.common.roles import Role
from tandem.common.tls import aio_channel
from tandem.services.router.circuit_breaker import CircuitBreaker
from tandem.services.router.config import DnsTarget, RouterConfig, WorkerEndpoint
from tandem.services.router.kv_index import KvBlockIndex
from tandem.common.rpc.stream_client import WorkerStream

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# Reconnect quickly after a worker restarts: gRPC's default backoff grows to two minutes.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", 30000),
]
KV_RESUBSCRIBE_S = 1.0
DRAIN_POLL_S = 0.05


@dataclass
class WorkerLoad:
    running: int = 0
    waiting: int = 0


@dataclass(eq=False)
class Placement:
    """KV tokens this router reserved on a worker for one leg, from dispatch until the leg ends."""

    tokens: int
    placed_at: float = field(default_factory=time.monotonic)


@dataclass
class KvCapacity:
    """A KV-holding worker's pool as this router knows it: the last GetLoads report plus the legs this router
    placed there. A report lags: a leg placed after the poll was sent is not in it yet."""

    total: int = 0  # the pool's tokens; 0 until the worker first reports
    used: int = 0  # tokens requests held at the last report (the evictable prefix cache is free)
    reported_at: float = 0.0  # when the poll behind `used` was sent
    placements: set[Placement] = field(default_factory=set)

    @property
    def reserved(self) -> int:
        return sum(p.tokens for p in self.placements)

    def committed(self) -> int:
        """What is spoken for: this router's reservations (worst case of what it sent), or the report plus what
        it does not show yet, whichever is more (the report also counts other routers' requests)."""
        unreflected = sum(p.tokens for p in self.placements if p.placed_at >= self.reported_at)
        return max(self.reserved, self.used + unreflected)

    def free(self) -> Optional[int]:
        """Tokens left, or None while the worker has not reported its pool."""
        return self.total - self.committed() if self.total else None

    def fits(self, tokens: int, pending: int = 0) -> bool:
        """Whether `tokens` more (and `pending` admitted elsewhere, not placed yet) fit. A request larger than
        the whole pool fits an otherwise empty worker, where the worker itself makes room as it decodes."""
        free = self.free()
        return free is None or free - pending >= min(tokens, self.total)


@dataclass(eq=False)
class DpRank:
    """One data-parallel rank of a `--dp-size N` worker as a routing target: its own RadixCache (from the KV-event
    batches tagged with its dp_rank), load and pool (from GetLoads per rank). A request routed to it is pinned
    there with `data_parallel_rank`."""

    worker: "Worker"
    dp_rank: int
    kv_index: KvBlockIndex = field(default_factory=KvBlockIndex)
    load: WorkerLoad = field(default_factory=WorkerLoad)
    kv: KvCapacity = field(default_factory=KvCapacity)
    in_flight: int = 0  # requests this router pinned here and has not seen finish

    def load_score(self) -> int:
        return max(self.in_flight, self.load.running + self.load.waiting)


class Worker:
    """One gRPC worker as the router sees it: channel, health, breaker, load, cached blocks; a `--dp-size N`
    worker also as its N ranks (`dp_ranks`), each a cache of its own."""

    dp_rank = None  # as a routing target the worker itself is unpinned: its DP controller chooses

    def __init__(self, endpoint: WorkerEndpoint, config: RouterConfig):
        self.endpoint = endpoint
        # Mutual TLS when --tls-* is set: the router proves itself to the worker and checks the worker's cert.
        self.channel = aio_channel(endpoint.address, config.tls, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.SglangSchedulerStub(self.channel)
        self.stream = WorkerStream(self.channel, endpoint.address)  # used once the worker says it serves one
        self.generate_stream = False  # whether it serves GenerateStream.Multiplex (its server info says)
        self.local_prefill = False  # a decode that prefills plain requests itself (its server info says)
        self.breaker = CircuitBreaker(config.breaker_failure_threshold, config.breaker_cooldown_s)
        self.healthy = False
        self.health_message = "not checked yet"
        self.load = WorkerLoad()
        self.in_flight = 0  # requests this router has sent and not seen finish
        # The legs running here, told (with the reason) when a health check finds the worker unhealthy.
        self.on_unhealthy: set[Callable[[str], None]] = set()
        self.kv = KvCapacity()
        self.kv_index = KvBlockIndex()
        self.dp_ranks: list[DpRank] = []  # empty unless the worker reports dp_size > 1
        self.model_info: Optional[pb.GetModelInfoResponse] = None
        self.start_time: Optional[float] = None  # the worker's, to tell a restart from a reconnect
        self.weight_version: Optional[str] = None  # a prefill and a decode of one pair must serve the same
        self.lora_adapters: list = []  # its LoadedLoRAAdapter list, refreshed by health checks and LoRA calls
        self.draining = False  # being removed: no new requests, the ones in flight finish
        self.tasks: list[asyncio.Task] = []

    @property
    def role(self) -> str:
        return self.endpoint.role

    def __repr__(self) -> str:
        return f"Worker({self.endpoint})"

    @property
    def worker(self) -> "Worker":
        """As a routing target (see `routing_targets`), the worker is its own."""
        return self

    def routing_targets(self) -> list:
        """What a policy that sees DP ranks chooses among: each rank of a DP worker, else the worker."""
        return self.dp_ranks or [self]

    def set_dp_size(self, dp_size: int) -> None:
        """The worker's DP size from its server info; ranks (and their caches) are rebuilt when it changes."""
        wanted = dp_size if dp_size > 1 else 0
        if len(self.dp_ranks) != wanted:
            self.dp_ranks = [DpRank(self, rank, KvBlockIndex(self.kv_index.page_size)) for rank in range(wanted)]

    def kv_index_of(self, batch: common_pb2.KvEventBatch) -> KvBlockIndex:
        """The cache a KV-event batch describes: its dp_rank's on a DP worker."""
        if self.dp_ranks and batch.HasField("dp_rank") and 0 <= batch.dp_rank < len(self.dp_ranks):
            return self.dp_ranks[batch.dp_rank].kv_index
        return self.kv_index

    def kv_indexes(self) -> list[KvBlockIndex]:
        return [r.kv_index for r in self.dp_ranks] or [self.kv_index]

    def lora_ids(self) -> set[str]:
        return {a.lora_id for a in self.lora_adapters}

    async def refresh_lora(self, timeout: float) -> None:
        try:
            reply = await self.stub.ListLoadedLoRAAdapters(pb.ListLoadedLoRAAdaptersRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:  # a worker without LoRA serves the base model only
                raise
            self.lora_adapters = []
            return
        self.lora_adapters = list(reply.loaded_adapters)

    def available(self) -> bool:
        return self.healthy and not self.draining and self.breaker.allows()

    def load_score(self) -> int:
        """Requests on the worker: the larger of what it last reported and what this router has in flight."""
        return max(self.in_flight, self.load.running + self.load.waiting)

    def record_result(self, ok: bool) -> None:
        if ok:
            self.breaker.record_success()
        else:
            self.breaker.record_failure()

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.stream.close()
        await self.channel.close()


class WorkerRegistry:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.workers: dict[WorkerEndpoint, Worker] = {}
        self._tasks: list[asyncio.Task] = []
        # Called when capacity may have grown (a load report, a worker turning healthy): admission re-checks.
        self.listeners: list[Callable[[], None]] = []

    def capacity_changed(self) -> None:
        for listener in self.listeners:
            listener()

    # ---- membership -----------------------------------------------------------------------------

    async def start(self) -> None:
        for endpoint in [*self.config.prefill, *self.config.decode, *self.config.workers]:
            self._add(endpoint)
        if self.config.dns_targets:
            await self._resolve_all()
            self._tasks.append(asyncio.create_task(self._dns_loop(), name="dns-refresh"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(w.close() for w in self.workers.values()), return_exceptions=True)
        self.workers.clear()

    def add(self, endpoint: WorkerEndpoint) -> Worker:
        """A worker added at run time (the admin API): observed like a static one from now on."""
        return self._add(endpoint)

    async def drain(self, endpoint: WorkerEndpoint, timeout_s: float) -> int:
        """Remove a worker without failing a request: it gets no new ones at once (dispatch picks and counts a
        leg in one step, so none slips in after), the ones in flight finish, then it is closed. Returns the
        requests still in flight when `timeout_s` ran out (0: drained); the worker is removed either way."""
        worker = self.workers[endpoint]
        worker.draining = True
        deadline = time.monotonic() + timeout_s
        while worker.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        left = worker.in_flight
        if self.workers.get(endpoint) is worker:
            del self.workers[endpoint]
            await worker.close()
        logger.info("removed worker %s (%s)", endpoint, "drained" if not left else f"{left} request(s) cut off")
        return left

    def _add(self, endpoint: WorkerEndpoint) -> Worker:
        if endpoint in self.workers:
            return self.workers[endpoint]
        worker = Worker(endpoint, self.config)
        self.workers[endpoint] = worker
        worker.tasks.append(asyncio.create_task(self._health_loop(worker), name=f"health {endpoint}"))
        worker.tasks.append(asyncio.create_task(self._load_loop(worker), name=f"loads {endpoint}"))
        if self.config.kv_events:  # a decode's cache tells --disagg-policy auto what it could prefill cheaply
            worker.tasks.append(asyncio.create_task(self._kv_event_loop(worker), name=f"kv-events {endpoint}"))
        logger.info("added worker %s", endpoint)
        return worker

    async def _remove(self, endpoint: WorkerEndpoint) -> None:
        worker = self.workers.pop(endpoint, None)
        if worker is not None:
            logger.info("removed worker %s (no longer in DNS)", endpoint)
            await worker.close()

    async def _resolve(self, target: DnsTarget) -> set[WorkerEndpoint]:
        infos = await asyncio.get_running_loop().getaddrinfo(target.name, target.port, type=socket.SOCK_STREAM)
        return {WorkerEndpoint(target.role, info[4][0], target.port, target.bootstrap_port) for info in infos}

    async def _resolve_all(self) -> None:
        wanted: set[WorkerEndpoint] = set()
        resolved_targets: set[DnsTarget] = set()
        for target in self.config.dns_targets:
            try:
                wanted |= await self._resolve(target)
                resolved_targets.add(target)
            except (OSError, socket.gaierror) as e:  # keep what we have: a DNS blip is not a dead fleet
                logger.warning("cannot resolve %s: %s", target.name, e)
        static = {*self.config.prefill, *self.config.decode, *self.config.workers}
        for endpoint in wanted:
            self._add(endpoint)
        for endpoint in list(self.workers):
            from_resolved = any(t.role == endpoint.role and t.port == endpoint.port for t in resolved_targets)
            if endpoint not in static and endpoint not in wanted and from_resolved:
                await self._remove(endpoint)

    async def _dns_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.dns_refresh_s)
            await self._resolve_all()

    # ---- observation loops -----------------------------------------------------------------------

    async def _health_loop(self, worker: Worker) -> None:
        while True:
            await self.check_health(worker)
            await asyncio.sleep(self.config.health_check_interval_s)

    async def check_health(self, worker: Worker) -> None:
        timeout = self.config.health_check_timeout_s
        try:
            reply = await worker.stub.HealthCheck(pb.HealthCheckRequest(), timeout=timeout)
            healthy, message = reply.healthy, reply.message
            if healthy and worker.model_info is None:
                worker.model_info = await worker.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout)
            if healthy:
                info = await worker.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout)
                self._note_start_time(worker, info)
                await worker.refresh_lora(timeout)
        except grpc.aio.AioRpcError as e:
            healthy, message = False, f"{e.code().name}: {e.details()}"
        except Exception as e:  # noqa: BLE001 - a probe must never kill its loop
            healthy, message = False, repr(e)
        if healthy != worker.healthy:
            logger.log(logging.INFO if healthy else logging.WARNING, "worker %s is now %s (%s)", worker.endpoint,
                       "healthy" if healthy else "unhealthy", message)
        if healthy and not worker.healthy:
            await self.poll_loads(worker)  # its KV capacity, before admission counts on it
        lost = worker.healthy and not healthy
        worker.healthy, worker.health_message = healthy, message
        if lost:
            for leg_failed in list(worker.on_unhealthy):
                leg_failed(message)
        if healthy:
            if worker.breaker.state != "closed":
                worker.breaker.record_success()
            self.capacity_changed()
        else:
            worker.breaker.record_failure()

    def _note_start_time(self, worker: Worker, info: pb.GetServerInfoResponse) -> None:
        start = info.start_time.seconds + info.start_time.nanos / 1e9
        dp_size = info.server_args.fields.get("dp_size") if info.HasField("server_args") else None
        stream = info.server_args.fields.get("generate_stream") if info.HasField("server_args") else None
        worker.generate_stream = stream is not None and stream.bool_value
        local = info.scheduler_info.fields.get("local_prefill") if info.HasField("scheduler_info") else None
        worker.local_prefill = worker.role == Role.DECODE and local is not None and local.bool_value
        worker.set_dp_size(int(dp_size.number_value) if dp_size is not None else 1)
        page_size = info.scheduler_info.fields.get("page_size") if info.HasField("scheduler_info") else None
        version = info.scheduler_info.fields.get("weight_version") if info.HasField("scheduler_info") else None
        if version is not None:
            worker.weight_version = version.string_value
        for index in worker.kv_indexes():
            if page_size is not None and index.page_size is None:
                index.page_size = int(page_size.number_value)
        if worker.start_time is not None and start != worker.start_time:
            logger.warning("worker %s restarted; forgetting its cached blocks", worker.endpoint)
            for index in worker.kv_indexes():
                index.reset()
        worker.start_time = start

    async def _load_loop(self, worker: Worker) -> None:
        while True:
            await asyncio.sleep(self.config.load_poll_interval_s)
            if worker.healthy:
                await self.poll_loads(worker)

    async def poll_loads(self, worker: Worker) -> None:
        """GetLoads: request counts for the policies, KV pool figures for admission."""
        sent_at = time.monotonic()
        try:
            reply = await worker.stub.GetLoads(pb.GetLoadsRequest(), timeout=self.config.health_check_timeout_s)
        except grpc.aio.AioRpcError:
            return  # the health loop judges the worker
        if not reply.loads:
            return
        worker.load = WorkerLoad(sum(x.num_running_reqs for x in reply.loads),
                                 sum(x.num_waiting_reqs for x in reply.loads))
        worker.kv.total = sum(x.max_total_num_tokens for x in reply.loads)
        worker.kv.used = sum(x.num_used_tokens for x in reply.loads)
        worker.kv.reported_at = sent_at
        for x in reply.loads:
            if 0 <= x.dp_rank < len(worker.dp_ranks):
                rank = worker.dp_ranks[x.dp_rank]
                rank.load = WorkerLoad(x.num_running_reqs, x.num_waiting_reqs)
                rank.kv.total, rank.kv.used, rank.kv.reported_at = x.max_total_num_tokens, x.num_used_tokens, sent_at
        self.capacity_changed()

    async def _kv_event_loop(self, worker: Worker) -> None:
        """Follow the worker's KV events; after a reconnect resume from the last batch (replayed from its
        history), after a restart start over from its first batch. A DP worker's ranks number their batches
        apart: resume from the rank furthest behind (each index skips what it already applied)."""
        while True:
            if not worker.healthy:
                await asyncio.sleep(KV_RESUBSCRIBE_S)
                continue
            start = min(index.last_sequence for index in worker.kv_indexes()) + 1
            request = common_pb2.SubscribeKvEventsRequest(start_sequence_number=start,
                                                          load_records_before_first_batch=True)
            try:
                async for batch in worker.stub.SubscribeKvEvents(request):
                    worker.kv_index_of(batch).apply(batch)
                    if batch.HasField("load"):
                        self._note_pushed_load(worker, batch)
            except grpc.aio.AioRpcError as e:
                logger.debug("KV events of %s ended: %s", worker.endpoint, e.code().name)
            await asyncio.sleep(KV_RESUBSCRIBE_S)

    @staticmethod
    def _note_pushed_load(worker: Worker, batch: common_pb2.KvEventBatch) -> None:
        load = WorkerLoad(batch.load.running_requests, batch.load.waiting_requests)
        if not worker.dp_ranks:
            worker.load = load
            return
        if batch.HasField("dp_rank") and 0 <= batch.dp_rank < len(worker.dp_ranks):
            worker.dp_ranks[batch.dp_rank].load = load
        worker.load = WorkerLoad(sum(r.load.running for r in worker.dp_ranks),
                                 sum(r.load.waiting for r in worker.dp_ranks))

    # ---- queries ---------------------------------------------------------------------------------

    def by_role(self, role: str, available_only: bool = True) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role and (w.available() or not available_only)]

    def serving_decodes(self) -> list[Worker]:
        """The available decode workers that can take a request now: all of them beside an available prefill
        worker, else those that prefill locally."""
        decodes = self.by_role(Role.DECODE)
        return decodes if self.by_role(Role.PREFILL) else [d for d in decodes if d.local_prefill]

    def kv_holders(self) -> list[Worker]:
        """The available workers whose KV pool a request's whole generation occupies: decode workers when one
        can serve (beside a prefill worker, or prefilling locally; as dispatch prefers), else unified workers."""
        return self.serving_decodes() or self.by_role(Role.UNIFIED)

    def ready(self) -> bool:
        return bool(self.by_role(Role.UNIFIED)) or bool(self.serving_decodes())

    def any_model_info(self) -> Optional[pb.GetModelInfoResponse]:
        for worker in self.workers.values():
            if worker.model_info is not None:
                return worker.model_info
        return None

    def lora_adapters(self) -> dict[str, object]:
        """Every LoRA adapter some worker has loaded, by the name clients select it with (OpenAI `model`)."""
        return {a.lora_name: a for w in self.workers.values() for a in w.lora_adapters}

    def max_context_length(self) -> Optional[int]:
        lengths = [w.model_info.max_context_length for w in self.workers.values()
                   if w.model_info is not None and w.model_info.max_context_length > 0]
        return min(lengths) if lengths else None

    def snapshot(self) -> list[dict]:
        return [{"address": w.endpoint.address, "role": w.role, "healthy": w.healthy, "message": w.health_message,
                 "breaker": w.breaker.state, "draining": w.draining, "in_flight": w.in_flight, "running": w.load.running,
                 "waiting": w.load.waiting, "cached_blocks": sum(len(i.blocks) for i in w.kv_indexes()),
                 "kv_total_tokens": w.kv.total, "kv_free_tokens": w.kv.free(), "kv_reserved_tokens": w.kv.reserved,
                 "generate_stream": w.generate_stream and self.config.worker_stream,
                 "dp_ranks": [{"dp_rank": r.dp_rank, "running": r.load.running, "waiting": r.load.waiting,
                               "in_flight": r.in_flight, "cached_blocks": len(r.kv_index.blocks)}
                              for r in w.dp_ranks]}
                for w in self.workers.values()]
