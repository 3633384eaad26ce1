"""Prefill half of the KV transfer's room state: destinations from decode, chunked WRITEs, decode liveness."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc
import numpy as np

from tandem.common.proto_gen.tandem import bootstrap_pb2 as pb
from tandem.common.transfer.failures import FailureKind, TransferFailure
from tandem.common.transfer.messages import KVPoll, KVTransferMetadata, RoomState, TransferConfig
from tandem.common.transfer.nixl_backend import NixlBackend, RemotePool
from tandem.common.transfer.rank_plan import (RankPool, RankWrite, decode_pools, plan_to_proto, plan_writes,
                                              pools_mismatch, rank_writes)

logger = logging.getLogger(__name__)


class BootstrapRejected(Exception):
    """A bootstrap call the prefill refuses; `code` becomes the gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Destination:
    engine_id: str
    dst_pages: np.ndarray
    skip_pages: int  # leading prompt pages the decode already holds
    request_id: str
    received_at: float = field(default_factory=time.monotonic)


@dataclass
class DecodePeer:
    engine_id: str
    pool: RemotePool  # decode rank 0's: where notifications go
    writes: list[RankWrite]  # what this rank (prefill rank 0) WRITEs, one per decode rank it serves
    followers: frozenset[int] = frozenset()  # other prefill ranks that WRITE into this decode and report each room
    agents: tuple[str, ...] = ()  # every remote agent added for it here
    last_seen: float = field(default_factory=time.monotonic)


@dataclass
class Chunk:
    src_pages: np.ndarray
    is_last: bool
    metadata: KVTransferMetadata | None


@dataclass
class SenderRoom(RoomState):
    request_id: str = ""
    destination: Destination | None = None
    pending: deque = field(default_factory=deque)  # Chunks not yet posted (appended by the scheduler thread)
    next_position: int = 0  # prompt page position of the next chunk's first page
    in_flight: list = field(default_factory=list)  # NIXL handles
    final: KVTransferMetadata | None = None  # set once the last chunk is posted
    held_at: float | None = None  # last heartbeat in which a decode said it holds the room, waiting for pages
    waiting_ranks: set = field(default_factory=set)  # follower ranks whose WRITEs of the room have not all completed
    told_ranks: bool = False  # the followers were sent a chunk of this room (a failure must tell them to drop it)


class PrefillSide:
    """All prefill-side room state. gRPC handlers and facades mutate it under `_lock`;
    NIXL calls happen only in `step`, on the manager's transfer thread.

    Under tensor parallelism this is rank 0's: `pools` holds every rank's pool shard, `ranks` (the TP runner)
    carries RankCommands to the other ranks, which WRITE their heads themselves and report each room back as a
    NIXL notification (RankReport); a room completes only when rank 0's WRITEs and every follower's did."""

    def __init__(self, backend: NixlBackend, config: TransferConfig, wake: threading.Event,
                 pools: list[RankPool] | None = None, total_heads: int = 0, ranks=None):
        self.backend, self.config, self._wake = backend, config, wake
        lay = backend.layout
        self.pools = pools or [RankPool(0, backend.agent_name, backend.metadata, backend.layout_proto(),
                                        range(lay.num_kv_heads))]
        self.total_heads = total_heads or lay.num_kv_heads
        self._ranks = ranks
        self._rank_agents = {p.agent_name: p.rank for p in self.pools[1:]}
        self._rank_outbox: list[tuple[int | None, pb.RankCommand]] = []  # (room, command), sent after _lock
        self.weight_version = "default"  # the engine's, kept current by RuntimeControl (KVManager.set_weight_version)
        self._lock = threading.Lock()
        self._peers: dict[str, DecodePeer] = {}
        self._rooms: dict[int, SenderRoom] = {}
        self._early_destinations: dict[int, Destination] = {}  # arrived before the sender existed
        self._aborted: dict[int, tuple[TransferFailure, float]] = {}  # room -> (why, when): refuses late destinations
        self._commands: queue.Queue = queue.Queue()  # callables run on the transfer thread
        self._orphans: list = []  # (handle, since) of failed rooms, released once no longer in progress

    # ---- gRPC handlers (server threads) ----
    def register_decode(self, req: pb.RegisterDecodeRequest) -> pb.RegisterDecodeResponse:
        """Pair with a decode engine. An engine id is bound to the NIXL agent that registered it while that agent
        heartbeats: another agent claiming a live id (an impostor, or a second process with the same
        --engine-id) is refused, so it can neither receive this prefill's KV nor break the live pair. Once the
        old agent is declared dead, a new one may take the id (a restarted decode)."""
        decode, decode_heads = decode_pools(req)
        problem = pools_mismatch(self.pools, self.total_heads, decode, decode_heads)
        if problem:
            raise BootstrapRejected(grpc.StatusCode.FAILED_PRECONDITION, problem)
        plan = plan_writes(self.pools, decode)
        with self._lock:
            self._refuse_if_held(req.engine_id, req.agent_name, time.monotonic())
        agent_name, own_writes, agents = self._load_decode_agents(req, plan)
        if agent_name != req.agent_name:
            with self._lock:
                self._forget_agents(agents)
            raise BootstrapRejected(grpc.StatusCode.INVALID_ARGUMENT, f"agent_name {req.agent_name!r} does "
                                    f"not match the agent metadata's ({agent_name!r})")
        followers = frozenset(rank for rank, targets in plan.items() if rank != 0 and targets)
        if self._ranks is not None:  # before the peer exists here, so that no WRITE for it reaches a rank first
            try:
                self._ranks.send_kv_command(pb.RankCommand(add_decode=plan_to_proto(req.engine_id, plan))
                                            .SerializeToString())
            except Exception as e:
                raise BootstrapRejected(grpc.StatusCode.UNAVAILABLE, f"this prefill's tensor-parallel ranks cannot "
                                        f"take the decode: {e}")
        with self._lock:
            try:
                self._refuse_if_held(req.engine_id, agent_name, time.monotonic())  # a racing registration won
            except BootstrapRejected:
                self._forget_agents(agents)
                raise
            old = self._peers.get(req.engine_id)
            if old is not None and old.pool.agent_name != agent_name:
                # Same engine, new agent after the old one died: its old pool addresses are meaningless.
                now = time.monotonic()
                for room in list(self._rooms.values()):
                    if room.destination is not None and room.destination.engine_id == req.engine_id:
                        self._fail(room, TransferFailure(FailureKind.PEER_LOST, f"decode engine {req.engine_id} restarted"),
                                   now, tell_decode=False)
            self._peers[req.engine_id] = DecodePeer(req.engine_id, RemotePool.from_proto(agent_name, req.layout),
                                                    own_writes, followers, agents)
        logger.info("decode %s registered (agent %s, %d ranks; prefill %d ranks)", req.engine_id, agent_name,
                    len(decode), len(self.pools))
        return pb.RegisterDecodeResponse(engine_id=self.config.engine_id, agent_name=self.backend.agent_name,
                                         tp_size=len(self.pools))

    def _load_decode_agents(self, req: pb.RegisterDecodeRequest, plan) -> tuple[str, list[RankWrite], tuple[str, ...]]:
        """On the transfer thread (NIXL calls live there): load decode rank 0's agent (notifications go there) and
        every decode rank's this rank WRITEs into. Returns rank 0's agent name, this rank's writes, and every agent
        added (all removed again when one fails)."""
        done: Future = Future()

        def add_agents() -> None:
            added: list[str] = []
            loaded: dict[bytes, str] = {}  # decode rank 0 is usually both notified and written to: load it once

            def add_remote(metadata: bytes) -> str:
                if metadata not in loaded:
                    loaded[metadata] = self.backend.add_remote(metadata)
                    added.append(loaded[metadata])
                return loaded[metadata]
            try:
                leader = add_remote(req.agent_metadata)
                own = rank_writes(plan[0], self.backend.layout.num_kv_heads, add_remote)
                done.set_result((leader, own, tuple(added)))
            except Exception as e:
                for agent in added:
                    self.backend.remove_remote(agent)
                done.set_exception(e)

        self._commands.put(add_agents)
        self._wake.set()
        try:
            return done.result(timeout=self.config.rpc_timeout_s)
        except Exception as e:
            raise BootstrapRejected(grpc.StatusCode.INVALID_ARGUMENT, f"cannot load decode agent metadata: {e}")

    def _forget_agents(self, agents: tuple[str, ...]) -> None:
        """Under _lock: remove the agents a refused registration loaded, except those a registered peer uses."""
        in_use = {a for peer in self._peers.values() for a in peer.agents}
        unused = [a for a in agents if a not in in_use]
        self._commands.put(lambda: [self.backend.remove_remote(a) for a in unused])

    def _refuse_if_held(self, engine_id: str, agent_name: str, now: float) -> None:
        """Under _lock: ALREADY_EXISTS when a live peer (heartbeat within peer_dead_after_s) holds engine_id
        with another agent."""
        held = self._peers.get(engine_id)
        if held is None or held.pool.agent_name == agent_name:
            return
        silent = now - held.last_seen
        if silent <= self.config.peer_dead_after_s:
            raise BootstrapRejected(
                grpc.StatusCode.ALREADY_EXISTS,
                f"decode engine id {engine_id!r} is held by live agent {held.pool.agent_name!r} (last heartbeat "
                f"{silent:.1f}s ago); a new agent may take it once that one misses heartbeats for "
                f"{self.config.peer_dead_after_s:g}s. Give every decode its own --engine-id")

    def set_destination(self, req: pb.SendDestinationRequest) -> None:
        if req.weight_version != self.weight_version:
            raise BootstrapRejected(grpc.StatusCode.FAILED_PRECONDITION, (
                f"room {req.room}: decode engine {req.engine_id!r} serves weight version {req.weight_version!r}, this "
                f"prefill {self.weight_version!r}; KV of one version is never decoded with another"))
        dst = Destination(req.engine_id, np.asarray(req.dst_page_indices, dtype=np.int64),
                          max(req.prefix_tokens, 0) // self.backend.layout.page_size, req.request_id)
        with self._lock:
            if req.engine_id not in self._peers:
                raise BootstrapRejected(grpc.StatusCode.FAILED_PRECONDITION, f"decode engine {req.engine_id!r} is not registered")
            if req.room in self._aborted:
                raise BootstrapRejected(grpc.StatusCode.ABORTED, f"room {req.room} was aborted by prefill: {self._aborted[req.room][0].message}")
            room = self._rooms.get(req.room)
            taken = room.destination if room is not None else self._early_destinations.get(req.room)
            if taken is not None:  # a second decode leg drew this room: it must not steal the first one's KV
                raise BootstrapRejected(grpc.StatusCode.ALREADY_EXISTS, f"room {req.room} already has a destination "
                                        f"(decode {taken.engine_id}, request {taken.request_id!r})")
            if room is None:
                self._early_destinations[req.room] = dst
            else:
                self._attach(room, dst)
        self._wake.set()

    def heartbeat(self, engine_id: str, pending_rooms=()) -> bool:
        """A registered decode is alive; the rooms it names wait in its prealloc queue, so their bootstrap timeout
        starts again (it counts from when the decode could reserve pages, not from arrival)."""
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is None:
                return False
            peer.last_seen = now = time.monotonic()
            for room_id in pending_rooms:
                room = self._rooms.get(room_id)
                if room is not None and room.destination is None:
                    room.held_at = now
            return True

    def abort_from_decode(self, room_id: int, engine_id: str, reason: str, kind: FailureKind | None) -> None:
        with self._lock:
            why = TransferFailure(kind or FailureKind.ABORTED, f"aborted by decode {engine_id}: {reason}")
            self._aborted[room_id] = (why, time.monotonic())
            self._early_destinations.pop(room_id, None)
            room = self._rooms.get(room_id)
            if room is not None:
                self._finish(room, why, tell_decode=False)

    # ---- facade calls (scheduler thread) ----
    def add_sender(self, room_id: int, request_id: str) -> SenderRoom:
        """A room for one prefill leg; a room id another live leg holds fails this one at once (the first is
        untouched)."""
        room = SenderRoom(room=room_id, request_id=request_id)
        with self._lock:
            holder = self._rooms.get(room_id)
            if holder is not None:
                room.fail(TransferFailure(FailureKind.ROOM_IN_USE, f"bootstrap_room {room_id} is in use by request "
                                          f"{holder.request_id!r} on this prefill; each pair needs its own room"))
                return room
            if room_id in self._aborted:
                room.fail(self._aborted[room_id][0])
                return room
            self._rooms[room_id] = room
            early = self._early_destinations.pop(room_id, None)
            if early is not None:
                self._attach(room, early)
        self._wake.set()
        return room

    def send(self, room: SenderRoom, src_pages, is_last: bool, metadata: KVTransferMetadata | None) -> None:
        if room.state.terminal:
            return
        room.pending.append(Chunk(np.asarray(src_pages, dtype=np.int64).reshape(-1), is_last, metadata))
        self._wake.set()

    def abort(self, room: SenderRoom, reason: str) -> None:
        if room.state.terminal:  # e.g. refused at birth: the room id may belong to another live leg
            return
        with self._lock:
            self._fail(room, TransferFailure(FailureKind.ABORTED, f"aborted by prefill: {reason}"), time.monotonic())
        self._wake.set()

    # ---- transfer thread ----
    def has_rooms(self) -> bool:
        return bool(self._rooms) or not self._commands.empty()

    def step(self) -> bool:
        """One pass over commands, rooms, deadlines and liveness; True if work is in flight."""
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                break
        # Without NIXL's progress thread, UCX moves queued sends (our notifications) only while
        # someone polls the worker: do it every step, even with no room in flight.
        notes = self.backend.new_notifications()
        now = time.monotonic()
        busy = False
        with self._lock:  # NIXL posts and polls are non-blocking, so holding the lock here stays short
            for agent_name, payload in notes:
                self._on_rank_report(agent_name, payload, now)
            for room in list(self._rooms.values()):
                try:
                    busy |= self._progress(room, now)
                except Exception as e:  # one broken room must not stall the others
                    logger.exception("room %d", room.room)
                    self._fail(room, TransferFailure(FailureKind.TRANSFER_ERROR, f"internal transfer error: {e}"), now)
            self._check_deadlines(now)
            dead = self._check_liveness(now)
            outbox, self._rank_outbox = self._rank_outbox, []
        for peer in dead:
            for agent_name in peer.agents:
                self.backend.remove_remote(agent_name)
            if self._ranks is not None:
                outbox.append((None, pb.RankCommand(remove_decode=pb.RemoveDecode(engine_id=peer.engine_id))))
        self._send_to_ranks(outbox)
        self._release_orphans()
        return busy or bool(self._orphans)

    def _on_rank_report(self, agent_name: str, payload: bytes, now: float) -> None:
        """Under _lock: a follower rank's outcome of a room (its WRITEs all completed, or one failed)."""
        rank = self._rank_agents.get(agent_name)
        if rank is None:
            logger.debug("unexpected notification from %s dropped", agent_name)
            return
        report = pb.RankReport.FromString(payload)
        room = self._rooms.get(report.room)
        if room is None or rank not in room.waiting_ranks:
            return  # the room already failed here
        if report.ok:
            room.waiting_ranks.discard(rank)
        else:
            self._fail(room, TransferFailure(FailureKind.TRANSFER_ERROR, f"prefill tensor-parallel {report.error}"), now)

    def _send_to_ranks(self, outbox: list[tuple[int | None, pb.RankCommand]]) -> None:
        """The other ranks' commands, in order, outside _lock (a broadcast waits for the forward in progress); a
        room whose command cannot be sent fails (the ranks are gone: the engine fails fast too)."""
        for i, (room_id, command) in enumerate(outbox):
            try:
                self._ranks.send_kv_command(command.SerializeToString())
            except Exception as e:
                failure = TransferFailure(FailureKind.TRANSFER_ERROR, f"prefill tensor-parallel ranks unreachable: {e}")
                with self._lock:
                    for failed_room in {r for r, _ in outbox[i:] if r is not None}:
                        room = self._rooms.get(failed_room)
                        if room is not None:
                            self._fail(room, failure, time.monotonic())
                    self._rank_outbox.clear()  # nobody can take them
                return

    def _progress(self, room: SenderRoom, now: float) -> bool:
        """Under _lock: post pending chunks, reap finished WRITEs, complete the room."""
        if room.state.terminal or room.destination is None:
            return False
        peer = self._peers.get(room.destination.engine_id)
        if peer is None:
            self._fail(room, TransferFailure(FailureKind.PEER_LOST, f"decode engine {room.destination.engine_id} is gone"), now)
            return False
        try:
            while room.pending and room.final is None:
                self._post(room, room.pending.popleft(), peer, now)
        except Exception as e:
            self._fail(room, TransferFailure(FailureKind.TRANSFER_ERROR, f"KV WRITE to decode {peer.engine_id} failed: {e}"), now)
            return False
        still, error = [], False
        for handle in room.in_flight:
            state = self.backend.state(handle)
            if state == "PROC":
                still.append(handle)
            else:
                error |= state == "ERR" or not self.backend.release(handle)
        room.in_flight = still
        if error:
            self._fail(room, TransferFailure(FailureKind.TRANSFER_ERROR, f"NIXL WRITE to decode {peer.engine_id} reported an error"),
                       now)
            return False
        if room.final is not None and not room.in_flight and not room.waiting_ranks:
            self._complete(room, peer, now)
        return bool(room.in_flight or room.waiting_ranks)

    def _post(self, room: SenderRoom, chunk: Chunk, peer: DecodePeer, now: float) -> None:
        dst = room.destination
        positions = np.arange(room.next_position, room.next_position + len(chunk.src_pages))
        room.next_position += len(chunk.src_pages)
        if room.started_at is None:
            room.started_at = now
            room.state = KVPoll.Transferring
        if len(positions) and positions[-1] >= len(dst.dst_pages):
            raise ValueError(f"room {room.room} sent {room.next_position} pages, destination holds {len(dst.dst_pages)}")
        keep = positions >= dst.skip_pages
        src, dst_pages = chunk.src_pages[keep], dst.dst_pages[positions[keep]]
        if keep.any():
            room.in_flight.extend(write.post(self.backend, src, dst_pages) for write in peer.writes)
        if peer.followers and (keep.any() or chunk.is_last):
            if not room.told_ranks:
                room.told_ranks, room.waiting_ranks = True, set(peer.followers)
            write = pb.WriteChunk(room=room.room, engine_id=peer.engine_id, src_pages=src.tolist(),
                                  dst_pages=dst_pages.tolist(), is_last=chunk.is_last)
            self._rank_outbox.append((room.room, pb.RankCommand(write=write)))
        if chunk.is_last:
            room.final = chunk.metadata or KVTransferMetadata()

    def _complete(self, room: SenderRoom, peer: DecodePeer, now: float) -> None:
        meta = room.final
        if meta.room is None:
            meta.room = room.room
        note = pb.KVNotification(room=room.room, done=meta.to_proto())
        # Sent only after every WRITE of the room completed remotely, so decode never sees it early.
        try:
            self.backend.notify(peer.pool.agent_name, note.SerializeToString())
        except Exception as e:
            self._fail(room, TransferFailure(FailureKind.TRANSFER_ERROR, f"cannot notify decode {peer.engine_id}: {e}"), now)
            return
        room.metadata, room.state = meta, KVPoll.Success
        self._rooms.pop(room.room, None)

    def _fail(self, room: SenderRoom, failure: TransferFailure, now: float, tell_decode: bool = True) -> None:
        """Under _lock: fail the room and refuse a late destination for it."""
        if room.state.terminal:  # first outcome wins; a room refused at birth owns no state here
            return
        self._aborted[room.room] = (failure, now)
        self._finish(room, failure, tell_decode)

    def _finish(self, room: SenderRoom, failure: TransferFailure, tell_decode: bool) -> None:
        """Under _lock: fail the room, forget it, and (optionally) tell its decode."""
        if not room.fail(failure):
            return
        if self._rooms.get(room.room) is room:
            del self._rooms[room.room]
        room.pending.clear()
        self._orphans.extend((handle, time.monotonic()) for handle in room.in_flight)
        room.in_flight = []
        if room.told_ranks:
            room.waiting_ranks.clear()
            self._rank_outbox.append((None, pb.RankCommand(drop=pb.DropRoom(room=room.room))))
        logger.warning("room %d failed (%s): %s", room.room, failure.kind, failure.message)
        peer = self._peers.get(room.destination.engine_id) if room.destination else None
        if tell_decode and peer is not None:
            abort = pb.RoomAborted(room=room.room, reason=failure.message, kind=failure.kind.value)
            note = pb.KVNotification(room=room.room, abort=abort)
            self._commands.put(lambda: self._notify_quietly(peer.pool.agent_name, note.SerializeToString()))

    def _notify_quietly(self, agent_name: str, payload: bytes) -> None:
        try:
            self.backend.notify(agent_name, payload)
        except Exception as e:
            logger.info("abort notification to %s lost: %s", agent_name, e)

    def _release_orphans(self) -> None:
        still, now = [], time.monotonic()
        for handle, since in self._orphans:
            if self.backend.state(handle) != "PROC":
                self.backend.release(handle)
            elif now - since < self.config.transfer_timeout_s:
                still.append((handle, since))
            # else: stuck for good (peer gone); leak the handle rather than poll it forever
        self._orphans = still

    def _attach(self, room: SenderRoom, dst: Destination) -> None:
        room.destination = dst
        if room.state == KVPoll.Bootstrapping:
            room.state = KVPoll.WaitingForInput

    def _check_deadlines(self, now: float) -> None:
        """Under _lock."""
        cfg = self.config
        for room in list(self._rooms.values()):
            waiting_since = max(room.created_at, room.held_at or 0.0)
            if room.destination is None and now - waiting_since > cfg.bootstrap_timeout_s:
                self._fail(room, TransferFailure(FailureKind.BOOTSTRAP_TIMEOUT, f"bootstrap timeout: no destination for "
                                                 f"room {room.room} after {cfg.bootstrap_timeout_s:g}s"), now, tell_decode=False)
            elif room.started_at is not None and now - room.started_at > cfg.transfer_timeout_s:
                self._fail(room, TransferFailure(FailureKind.TRANSFER_TIMEOUT, f"transfer timeout: room {room.room} not "
                                                 f"complete after {cfg.transfer_timeout_s:g}s"), now)
        keep_for = 2 * cfg.bootstrap_timeout_s + cfg.transfer_timeout_s
        for room_id in [r for r, (_, t) in self._aborted.items() if now - t > keep_for]:
            del self._aborted[room_id]
        for room_id in [r for r, d in self._early_destinations.items() if now - d.received_at > keep_for]:
            del self._early_destinations[room_id]

    def _check_liveness(self, now: float) -> list[DecodePeer]:
        """Under _lock: drop decodes that stopped heartbeating; returns them."""
        dead_after = self.config.peer_dead_after_s
        dead = [p for p in self._peers.values() if now - p.last_seen > dead_after]
        for peer in dead:
            failure = TransferFailure(FailureKind.PEER_LOST,
                                      f"decode engine {peer.engine_id} declared dead: no heartbeat for {dead_after:g}s")
            logger.warning(failure.message)
            for room in list(self._rooms.values()):
                if room.destination is not None and room.destination.engine_id == peer.engine_id:
                    self._fail(room, failure, now, tell_decode=False)
            del self._peers[peer.engine_id]
        return dead

    def close(self) -> None:
        with self._lock:
            for room in list(self._rooms.values()):
                self._finish(room, TransferFailure(FailureKind.SHUTDOWN, "prefill KV manager shut down"), tell_decode=True)
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                break
