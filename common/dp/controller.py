"""`DPControllerServicer`: the SglangScheduler API of a `--dp-size N` worker, in front of its N replica processes.

Seed 000's DataParallelController: each Generate (its n sequences together) goes whole to one replica chosen by
`DPBalancer`, on that replica's GenerateStream.Multiplex stream (`common/rpc/stream_client.py`); its Abort follows
it there; GetLoads reports every DP rank and the aggregate; calls that change a replica's state (flush, LoRA,
profiling) reach all of them; SubscribeKvEvents merges every replica's stream, each batch tagged with its dp_rank.
On a prefill, each room's replica is kept in `rooms` for the bootstrap proxy.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import datetime, timezone
from typing import AsyncIterator, Optional

import grpc
from google.protobuf import json_format
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tandem.common.config import TlsConfig
from tandem.common.dp.balance import DPBalancer, request_tokens
from tandem.common.dp.bootstrap_proxy import RoomRanks
from tandem.common.rpc.resume import RESUMED_OUTPUT_TOKENS_KEY
from tandem.common.rpc.server import MAX_MESSAGE_BYTES
from tandem.common.rpc.sessions import SESSION_CAPACITY_KEY, SESSION_ID_KEY
from tandem.common.rpc.servicer import HEALTH_PROBE_TIMEOUT_S, tandem_version
from tandem.common.rpc.stream_client import Ended, WorkerStream
from tandem.common.tls import aio_channel

DEFAULT_MAX_NEW_TOKENS = 128  # SamplingParams' default, for a request that leaves max_new_tokens unset
_FORWARDED_METADATA = ("traceparent", "tracestate", RESUMED_OUTPUT_TOKENS_KEY, SESSION_ID_KEY, SESSION_CAPACITY_KEY)


class DPControllerServicer(pb_grpc.SglangSchedulerServicer):
    """Proxies the SglangScheduler API to the replica chosen per request; `dead_rank` set by the watcher."""

    def __init__(self, addresses: list[str], balancer: DPBalancer, server_args: dict,
                 tls: Optional[TlsConfig] = None):
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        self.channels = [aio_channel(a, tls, options) for a in addresses]  # mutual TLS when configured
        self.stubs = [pb_grpc.SglangSchedulerStub(c) for c in self.channels]
        self.streams = [WorkerStream(c, a) for c, a in zip(self.channels, addresses)]  # Generate goes on these
        self.balancer = balancer
        self.server_args = server_args
        self.in_flight: set[str] = set()
        self.draining = False
        self.dead_rank: int | None = None
        self.rooms: RoomRanks | None = None  # a prefill's: which replica holds each room

    async def close(self) -> None:
        for stream in self.streams:
            stream.close()
        for channel in self.channels:
            await channel.close()

    def _live_stubs(self) -> list[tuple[int, pb_grpc.SglangSchedulerStub]]:
        return [(rank, stub) for rank, stub in enumerate(self.stubs) if self.balancer.loads[rank].alive]

    async def _pick(self, request, rid: str, sequences: int, tokens: int, context, pinned: bool) -> int:
        """The replica for this request: its `data_parallel_rank` when `pinned`, else the balancer's choice."""
        rank = None
        if pinned:
            rank = request.data_parallel_rank
            if not 0 <= rank < len(self.stubs):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"data_parallel_rank must be in [0, {len(self.stubs)}), got {rank}")
            request.ClearField("data_parallel_rank")  # the replica itself is one rank: 0
        try:
            return self.balancer.dispatch(rid, sequences, tokens, rank=rank)
        except ValueError as e:  # the request id is in flight already
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id: {e}")
        except RuntimeError as e:  # no live replica (or the pinned one is dead)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        if self.draining or self.dead_rank is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining; send new requests elsewhere")
        if not request.request_id:  # a name of our own, so an Abort of it finds its replica
            request.request_id = f"tandem-{uuid.uuid4().hex}"
        rid = request.request_id
        sp = request.sampling_params
        n = max(sp.n, 1)
        max_new = sp.max_new_tokens if sp.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS
        tokens = request_tokens(len(request.tokenized.input_ids), n, max_new)
        paired = self.rooms is not None and request.HasField("disaggregated_params")
        room = request.disaggregated_params.bootstrap_room if paired else None
        if room is not None and (bound := self.rooms.bound(room)) is not None:
            # The decode's destination came first and was placed by the room: the leg goes where its KV must be.
            request.data_parallel_rank = bound
        rank = await self._pick(request, rid, n, tokens, context, request.HasField("data_parallel_rank"))
        if room is not None:
            self.rooms.bind(room, rank)
        metadata = [(k, v) for k, v in context.invocation_metadata() if k in _FORWARDED_METADATA]
        # On the replica's Multiplex stream: one message a step for all of this controller's requests there.
        replies: asyncio.Queue = asyncio.Queue()
        handle = self.streams[rank].start(request, replies.put_nowait, metadata=metadata)
        self.in_flight.add(rid)
        try:
            while not isinstance(reply := await replies.get(), Ended):
                yield reply
            if reply.code != grpc.StatusCode.OK:  # the replica's own status (and failure kind) reaches the caller
                await context.abort(reply.code, reply.details or f"data-parallel replica {rank} failed",
                                    trailing_metadata=tuple(reply.trailing.items()))
            context.set_trailing_metadata(tuple(reply.trailing.items()))
        finally:
            handle.cancel()  # a client that went away: the replica aborts the request and frees its KV
            self.in_flight.discard(rid)
            self.balancer.finish(rid)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        rank = self.balancer.rank_of(request.request_id)
        targets = [(rank, self.stubs[rank])] if rank is not None else self._live_stubs()
        replies = await asyncio.gather(*(stub.Abort(request) for _, stub in targets))
        known = any(r.message == "abort sent" for r in replies)
        return pb.AbortResponse(success=True, message="abort sent" if known else "request not in flight here")

    async def HealthCheck(self, request: pb.HealthCheckRequest, context) -> pb.HealthCheckResponse:
        if self.dead_rank is not None:
            return pb.HealthCheckResponse(healthy=False, message=f"data-parallel replica {self.dead_rank} died")
        if self.draining:
            return pb.HealthCheckResponse(healthy=False, message="draining")
        replies = await asyncio.gather(*(stub.HealthCheck(request, timeout=HEALTH_PROBE_TIMEOUT_S + 2) for stub in self.stubs),
                                       return_exceptions=True)
        for rank, reply in enumerate(replies):
            if isinstance(reply, BaseException) or not reply.healthy:
                why = reply.message if not isinstance(reply, BaseException) else repr(reply)
                return pb.HealthCheckResponse(healthy=False, message=f"data-parallel replica {rank}: {why}")
        return pb.HealthCheckResponse(healthy=True, message="ok")

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        return await self._live_stubs()[0][1].GetModelInfo(request)

    async def GetServerInfo(self, request, context) -> pb.GetServerInfoResponse:
        info = await self._live_stubs()[0][1].GetServerInfo(request)
        args = json.loads(json_format.MessageToJson(info.server_args))
        info.server_args.update(json.loads(json.dumps({**args, **self.server_args}, default=str)))
        info.active_requests = len(self.in_flight)
        info.is_paused = info.is_paused or self.draining
        return info

    async def GetLoads(self, request: pb.GetLoadsRequest, context) -> pb.GetLoadsResponse:
        ranks = range(len(self.stubs))
        if request.HasField("dp_rank"):
            if not 0 <= request.dp_rank < len(self.stubs):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"dp_rank must be in [0, {len(self.stubs)}), got {request.dp_rank}")
            ranks = [request.dp_rank]
        one = pb.GetLoadsRequest(include=request.include)
        replies = await asyncio.gather(*(self.stubs[r].GetLoads(one) for r in ranks))
        loads = []
        for rank, reply in zip(ranks, replies):
            load = reply.loads[0]
            load.dp_rank = rank
            loads.append(load)
        return pb.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(), version=tandem_version(),
                                   dp_rank_count=len(self.stubs), loads=loads, aggregate=aggregate_loads(loads))

    async def FlushCache(self, request, context) -> common_pb2.FlushCacheResponse:
        return _all_succeeded(await asyncio.gather(*(s.FlushCache(request) for s in self.stubs)),
                              common_pb2.FlushCacheResponse)

    async def StartProfile(self, request, context) -> common_pb2.ProfileResponse:
        return _all_succeeded(await asyncio.gather(*(s.StartProfile(request) for s in self.stubs)),
                              common_pb2.ProfileResponse)

    async def StopProfile(self, request, context) -> common_pb2.ProfileResponse:
        return _all_succeeded(await asyncio.gather(*(s.StopProfile(request) for s in self.stubs)),
                              common_pb2.ProfileResponse)

    async def GetTokenizer(self, request, context) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        async for chunk in self._live_stubs()[0][1].GetTokenizer(request):
            yield chunk

    async def SubscribeKvEvents(self, request, context) -> AsyncIterator[common_pb2.KvEventBatch]:
        """Every replica's events on one stream, each batch tagged with its dp_rank. Sequence numbers are each
        rank's own (its RadixCache publishes them), so `start_sequence_number` resumes every rank from that
        number: a subscriber that tracks ranks apart resumes from the lowest rank's next number and skips the
        batches it already applied. A replica's stream that fails ends this one with its status."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=1024)

        async def follow(rank: int) -> None:
            try:
                async for batch in self.stubs[rank].SubscribeKvEvents(request):
                    batch.dp_rank = rank
                    await queue.put(batch)
                await queue.put((grpc.StatusCode.UNAVAILABLE, f"data-parallel replica {rank} ended its KV events"))
            except grpc.aio.AioRpcError as e:
                await queue.put((e.code(), f"data-parallel replica {rank}: {e.details()}"))

        tasks = [asyncio.create_task(follow(rank)) for rank in range(len(self.stubs))]
        try:
            while True:
                item = await queue.get()
                if isinstance(item, tuple):  # (status, why): a replica's stream ended
                    await context.abort(*item)
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        rid = request.request_id or f"tandem-embed-{uuid.uuid4().hex}"
        request.request_id = rid
        # EmbedRequest.data_parallel_rank has no presence: 0 is "no pin".
        pinned = request.data_parallel_rank != 0
        rank = await self._pick(request, rid, 1, len(request.tokenized.input_ids), context, pinned)
        try:
            return await self.stubs[rank].Embed(request)
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or f"data-parallel replica {rank} failed")
        finally:
            self.balancer.finish(rid)

    async def LoadLoRAAdapter(self, request, context) -> pb.LoadLoRAAdapterResponse:
        replies = await asyncio.gather(*(s.LoadLoRAAdapter(request) for s in self.stubs))
        return next((r for r in replies if not r.success), replies[0])

    async def UnloadLoRAAdapter(self, request, context) -> pb.UnloadLoRAAdapterResponse:
        replies = await asyncio.gather(*(s.UnloadLoRAAdapter(request) for s in self.stubs))
        return next((r for r in replies if not r.success), replies[0])

    async def ListLoadedLoRAAdapters(self, request, context) -> pb.ListLoadedLoRAAdaptersResponse:
        return await self.stubs[0].ListLoadedLoRAAdapters(request)


def aggregate_loads(loads: list[pb.SchedulerLoad]) -> pb.AggregateMetrics:
    """Totals of the requests over the DP ranks; averages of the usages and throughput."""
    count = max(len(loads), 1)
    running = sum(x.num_running_reqs for x in loads)
    waiting = sum(x.num_waiting_reqs for x in loads)
    return pb.AggregateMetrics(
        total_running_reqs=running, total_waiting_reqs=waiting, total_reqs=running + waiting,
        avg_token_usage=sum(x.token_usage for x in loads) / count,
        avg_throughput=sum(x.gen_throughput for x in loads) / count,
        avg_utilization=sum(x.utilization for x in loads) / count)


def _all_succeeded(replies, response_type):
    """One reply for a call every replica ran: success only if each succeeded, each rank's message."""
    message = "; ".join(f"dp {rank}: {r.message}" for rank, r in enumerate(replies))
    return response_type(success=all(r.success for r in replies), message=message)
