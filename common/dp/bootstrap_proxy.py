"""The bootstrap server of a `tandem prefill --dp-size N`: one port (the worker's advertised
`disaggregation_bootstrap_port`) in front of the N replicas' own bootstrap servers.

A decode only knows the bootstrap address the router or smg put in the request, and the room. The controller
dispatched the room's prefill leg, so it knows which replica holds the room (`RoomRanks`); this proxy sends each
room's calls there and fans the decode-wide calls (registration, heartbeats) out to every replica, each of which
loads the decode's NIXL agent and WRITEs its own rooms straight into the decode's pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Optional

import grpc

from tandem.common.config import TlsConfig
from tandem.common.proto_gen.tandem import bootstrap_pb2 as bpb
from tandem.common.proto_gen.tandem import bootstrap_pb2_grpc as bpb_grpc
from tandem.common.tls import add_port, aio_channel

logger = logging.getLogger(__name__)

# How long a destination for a room the controller has not seen yet waits for the room's prefill leg (the router
# and smg send both legs at once; the decode's bootstrap calls time out after 5 s).
ROOM_WAIT_S = 2.0
ROOM_TTL_S = 600.0  # a binding is forgotten after this: every leg of its room has ended or timed out by then


class RoomRanks:
    """Which replica holds each room: bound when the controller dispatches the room's prefill leg, or when a
    destination arrives first and waited `ROOM_WAIT_S` in vain (then SGLang's default, `room % dp_size`, and the
    leg that comes later follows that binding). Used on the controller's event loop only."""

    def __init__(self, dp_size: int):
        self.dp_size = dp_size
        self._ranks: OrderedDict[int, tuple[int, float]] = OrderedDict()  # oldest binding first
        self._arrived: dict[int, asyncio.Event] = {}

    def bound(self, room: int) -> Optional[int]:
        entry = self._ranks.get(room)
        return None if entry is None else entry[0]

    def bind(self, room: int, rank: int) -> None:
        self._forget_stale()
        self._ranks.pop(room, None)
        self._ranks[room] = (rank, time.monotonic())
        event = self._arrived.pop(room, None)
        if event is not None:
            event.set()

    async def rank_of(self, room: int, wait_s: float = ROOM_WAIT_S) -> int:
        """The room's replica, waiting up to `wait_s` for its prefill leg; then `room % dp_size`, bound."""
        if (rank := self.bound(room)) is not None:
            return rank
        event = self._arrived.setdefault(room, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), wait_s)
        except asyncio.TimeoutError:
            self._arrived.pop(room, None)
            if self.bound(room) is None:
                self.bind(room, room % self.dp_size)
        return self.bound(room)

    def _forget_stale(self) -> None:
        """Bindings outlive their leg (a late abort or destination must still find the replica) until ROOM_TTL_S."""
        cutoff = time.monotonic() - ROOM_TTL_S
        while self._ranks and next(iter(self._ranks.values()))[1] < cutoff:
            self._ranks.popitem(last=False)


class BootstrapProxy(bpb_grpc.BootstrapServicer):
    """Bootstrap on the controller: per-room calls to the room's replica, decode-wide calls to every replica.
    A replica's refusal keeps its status code (the decode maps it to a failure kind), its message names it."""

    def __init__(self, addresses: list[str], rooms: RoomRanks, engine_id: str, tls: Optional[TlsConfig] = None):
        self.channels = [aio_channel(a, tls) for a in addresses]
        self.stubs = [bpb_grpc.BootstrapStub(c) for c in self.channels]
        self.rooms = rooms
        self.engine_id = engine_id

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()

    async def _all(self, method: str, request, context, timeout: float) -> list:
        replies = await asyncio.gather(*(getattr(s, method)(request, timeout=timeout) for s in self.stubs),
                                       return_exceptions=True)
        for rank, reply in enumerate(replies):
            if isinstance(reply, grpc.aio.AioRpcError):
                await context.abort(reply.code(), f"data-parallel replica {rank}: {reply.details()}")
            if isinstance(reply, BaseException):
                raise reply
        return replies

    async def RegisterDecode(self, request, context) -> bpb.RegisterDecodeResponse:
        replies = await self._all("RegisterDecode", request, context, context.time_remaining() or 5.0)
        # Each replica's rank 0 notifies for all of its ranks (its followers report to it, never to the decode), so
        # one agent per replica covers every sender; the replicas share one tp size.
        return bpb.RegisterDecodeResponse(engine_id=self.engine_id, agent_name=replies[0].agent_name,
                                          agent_names=[r.agent_name for r in replies], tp_size=replies[0].tp_size)

    async def SendDestination(self, request, context) -> bpb.SendDestinationResponse:
        rank = await self.rooms.rank_of(request.room)
        try:
            return await self.stubs[rank].SendDestination(request, timeout=context.time_remaining() or 5.0)
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), f"data-parallel replica {rank}: {e.details()}")

    async def Heartbeat(self, request, context) -> bpb.HeartbeatResponse:
        """Every replica must know the decode: one that lost it (restarted, timed it out) fails the decode's rooms
        here as a single prefill would. Rooms a replica does not hold are ignored there."""
        replies = await self._all("Heartbeat", request, context, context.time_remaining() or 5.0)
        return bpb.HeartbeatResponse(engine_id=self.engine_id,
                                     decode_registered=all(r.decode_registered for r in replies))

    async def AbortRoom(self, request, context) -> bpb.AbortRoomResponse:
        rank = self.rooms.bound(request.room)
        stubs = self.stubs if rank is None else [self.stubs[rank]]  # a room not placed yet: wherever it lands
        await asyncio.gather(*(s.AbortRoom(request, timeout=context.time_remaining() or 5.0) for s in stubs),
                             return_exceptions=True)
        return bpb.AbortRoomResponse()


async def start_bootstrap_proxy(proxy: BootstrapProxy, host: str, port: int,
                                tls: Optional[TlsConfig] = None) -> tuple[grpc.aio.Server, int]:
    """Serve the proxy on host:port (0 picks a free port), mutual TLS as the replicas' own servers demand it."""
    server = grpc.aio.server()
    bpb_grpc.add_BootstrapServicer_to_server(proxy, server)
    bound = add_port(server, f"{host}:{port}", tls)
    if not bound:
        raise OSError(f"cannot bind the bootstrap server to {host}:{port} (--bootstrap-port)")
    await server.start()
    return server, bound
