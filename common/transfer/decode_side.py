"""Decode half of the KV transfer's room state: registration with prefills, destinations, notifications, liveness."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from tandem.common.proto_gen.tandem import bootstrap_pb2 as pb
import grpc

from tandem.common.transfer.bootstrap_client import BootstrapClient, BootstrapError
from tandem.common.transfer.failures import FailureKind, TransferFailure, failure_kind
from tandem.common.transfer.messages import KVPoll, KVTransferMetadata, RoomState, TransferConfig
from tandem.common.transfer.nixl_backend import NixlBackend
from tandem.common.transfer.rank_plan import RankPool

logger = logging.getLogger(__name__)


# A bootstrap call's gRPC status, as the failure kind of the rooms it fails.
_BOOTSTRAP_ERROR_KINDS = {
    grpc.StatusCode.UNAVAILABLE: FailureKind.BOOTSTRAP_UNREACHABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: FailureKind.BOOTSTRAP_UNREACHABLE,  # it did not answer within rpc_timeout_s
    grpc.StatusCode.ABORTED: FailureKind.ABORTED,
}


def bootstrap_failure(error: BootstrapError, registering: bool, message: str) -> TransferFailure:
    """Registration answers FAILED_PRECONDITION only for a KV layout the prefill cannot serve, and ALREADY_EXISTS
    when another live agent holds this engine id (a refused pairing); SendDestination answers ALREADY_EXISTS when
    the room already has a destination (another decode leg holds the room)."""
    if registering and error.code == grpc.StatusCode.FAILED_PRECONDITION:
        return TransferFailure(FailureKind.LAYOUT_MISMATCH, message)
    if not registering and error.code == grpc.StatusCode.ALREADY_EXISTS:
        return TransferFailure(FailureKind.ROOM_IN_USE, message)
    return TransferFailure(_BOOTSTRAP_ERROR_KINDS.get(error.code, FailureKind.REFUSED), message)


@dataclass
class PrefillPeer:
    address: str
    client: BootstrapClient
    registered: bool = False
    engine_id: str = ""
    agent_names: frozenset = frozenset()  # NIXL agents whose notifications we accept (one per prefill DP replica)
    missed: int = 0


@dataclass
class ReceiverRoom(RoomState):
    address: str = ""
    pending_init: tuple | None = None  # (dst_pages, prefix_tokens, request_id) until sent


class DecodeSide:
    """All decode-side room state under `_lock`. gRPC calls run on a small executor, NIXL
    notification polling on the manager's transfer thread, heartbeats on their own thread."""

    def __init__(self, backend: NixlBackend, config: TransferConfig, wake: threading.Event,
                 pools: list[RankPool] | None = None, total_heads: int = 0):
        """pools: every tensor-parallel rank's pool shard (rank 0's first), registered with each prefill so that
        its ranks WRITE into all of them; None: this process's one pool holds every head."""
        self.backend, self.config, self._wake = backend, config, wake
        self._rank_pools = [p.to_proto() for p in pools] if pools is not None and len(pools) > 1 else []
        self._total_heads = total_heads or backend.layout.num_kv_heads
        self.weight_version = "default"  # the engine's, kept current by RuntimeControl (KVManager.set_weight_version)
        self._lock = threading.Lock()
        self._peers: dict[str, PrefillPeer] = {}
        self._rooms: dict[int, ReceiverRoom] = {}
        self._rpc = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-bootstrap")
        self._layout = backend.layout_proto()

    # ---- facade calls (scheduler thread) ----
    def add_receiver(self, room_id: int, host: str, port: int) -> ReceiverRoom:
        """A room for one decode leg; a room id another live leg holds fails this one at once (the first is
        untouched, and no bootstrap call is made for the second)."""
        address = f"{host}:{port}"
        room = ReceiverRoom(room=room_id, address=address)
        with self._lock:
            if room_id in self._rooms:
                room.fail(TransferFailure(FailureKind.ROOM_IN_USE, f"bootstrap_room {room_id} is in use by another "
                                          "request on this decode; each pair needs its own room"))
                return room
            self._rooms[room_id] = room
            peer = self._peers.get(address)
            if peer is None:
                client = BootstrapClient(host, port, self.config.rpc_timeout_s, tls=self.config.tls)
                peer = self._peers[address] = PrefillPeer(address, client)
                self._rpc.submit(self._register, peer)
            elif peer.registered:
                room.state = KVPoll.WaitingForInput
        self._wake.set()
        return room

    def init(self, room: ReceiverRoom, dst_pages, prefix_tokens: int, request_id: str) -> None:
        with self._lock:
            if room.state.terminal or room.pending_init is not None or room.started_at is not None:
                return
            room.pending_init = ([int(p) for p in dst_pages], int(prefix_tokens), request_id)
            peer = self._peers.get(room.address)
            if peer is not None and peer.registered:
                self._start_destination(room, peer)

    def abort(self, room: ReceiverRoom, reason: str) -> None:
        with self._lock:
            self._finish(room, TransferFailure(FailureKind.ABORTED, f"aborted by decode: {reason}"), tell_prefill=True)

    # ---- executor threads ----
    def _register(self, peer: PrefillPeer) -> None:
        try:
            resp = peer.client.register(self.config.engine_id, self.backend.agent_name, self.backend.metadata, self._layout,
                                        self.weight_version, self._total_heads, self._rank_pools)
        except BootstrapError as e:
            with self._lock:
                self._drop_peer(peer, bootstrap_failure(e, True, f"registration with prefill {peer.address} failed: {e}"))
            return
        with self._lock:
            peer.registered, peer.engine_id = True, resp.engine_id
            peer.agent_names = frozenset(resp.agent_names) | {resp.agent_name}
            for room in self._rooms_at(peer.address):
                if room.state == KVPoll.Bootstrapping:
                    room.state = KVPoll.WaitingForInput
                    if room.pending_init is not None:
                        self._start_destination(room, peer)
        logger.info("registered with prefill %s (%s): %d prefill rank(s) write into %d rank(s) here", peer.engine_id,
                    peer.address, max(resp.tp_size, 1), max(len(self._rank_pools), 1))

    def _start_destination(self, room: ReceiverRoom, peer: PrefillPeer) -> None:
        """Under _lock."""
        dst_pages, prefix_tokens, request_id = room.pending_init
        room.pending_init, room.started_at, room.state = None, time.monotonic(), KVPoll.Transferring
        self._rpc.submit(self._send_destination, room, peer, dst_pages, prefix_tokens, request_id)

    def _send_destination(self, room: ReceiverRoom, peer: PrefillPeer, dst_pages, prefix_tokens, request_id) -> None:
        try:
            peer.client.send_destination(room.room, self.config.engine_id, dst_pages, prefix_tokens, request_id,
                                         self.weight_version)
        except BootstrapError as e:
            with self._lock:
                failure = bootstrap_failure(e, False, f"prefill {peer.address} refused the destination: {e}")
                self._finish(room, failure, tell_prefill=False)

    def _abort_quietly(self, peer: PrefillPeer, room_id: int, failure: TransferFailure) -> None:
        try:
            peer.client.abort_room(room_id, self.config.engine_id, failure.message, failure.kind.value)
        except BootstrapError as e:
            logger.info("abort of room %d not delivered: %s", room_id, e)

    # ---- transfer thread ----
    def has_rooms(self) -> bool:
        return bool(self._rooms)

    def step(self) -> bool:
        for agent_name, payload in self.backend.new_notifications():
            self._on_notification(agent_name, payload)
        now, cfg = time.monotonic(), self.config
        with self._lock:
            for room in list(self._rooms.values()):
                if room.state == KVPoll.Bootstrapping and now - room.created_at > cfg.bootstrap_timeout_s:
                    self._finish(room, TransferFailure(FailureKind.BOOTSTRAP_TIMEOUT, f"bootstrap timeout: prefill "
                                                       f"{room.address} not paired after {cfg.bootstrap_timeout_s:g}s"),
                                 tell_prefill=True)
                elif room.state == KVPoll.Transferring and now - room.started_at > cfg.transfer_timeout_s:
                    self._finish(room, TransferFailure(FailureKind.TRANSFER_TIMEOUT, f"transfer timeout: room {room.room} "
                                                       f"not complete after {cfg.transfer_timeout_s:g}s"),
                                 tell_prefill=True)
        return False

    def _on_notification(self, agent_name: str, payload: bytes) -> None:
        try:
            note = pb.KVNotification.FromString(payload)
        except DecodeError:
            logger.warning("undecodable notification from %s dropped", agent_name)
            return
        with self._lock:
            room = self._rooms.get(note.room)
            peer = self._peers.get(room.address) if room is not None else None
            if room is None or peer is None or agent_name not in peer.agent_names:
                logger.info("notification for room %d from %s ignored (unknown room or sender)", note.room, agent_name)
                return
            body = note.WhichOneof("body")
            if body == "abort":
                kind = failure_kind(note.abort.kind) or FailureKind.ABORTED
                self._finish(room, TransferFailure(kind, f"prefill {peer.engine_id} failed the room: {note.abort.reason}"),
                             tell_prefill=False)
            elif body == "done":
                meta = KVTransferMetadata.from_proto(note.done)
                if meta.room != room.room:
                    self._finish(room, TransferFailure(FailureKind.ROOM_MISMATCH, f"metadata room {meta.room} does not "
                                                       f"match room {room.room}"), tell_prefill=False)
                elif not meta.ok:
                    self._finish(room, TransferFailure(FailureKind.TRANSFER_ERROR, f"prefill {peer.engine_id} reported "
                                                       f"failure: {meta.error}"), tell_prefill=False)
                else:
                    room.metadata, room.state = meta, KVPoll.Success
                    self._rooms.pop(room.room, None)

    # ---- heartbeat thread ----
    def heartbeat_once(self) -> None:
        with self._lock:
            peers = [p for p in self._peers.values() if p.registered]
            # Rooms still waiting for pages here (no destination sent yet): the prefill keeps waiting for them.
            pending = {p.address: [r.room for r in self._rooms_at(p.address) if r.started_at is None] for p in peers}
        for peer in peers:
            try:
                resp = peer.client.heartbeat(self.config.engine_id, self.config.heartbeat_interval_s,
                                             pending[peer.address])
            except BootstrapError as e:
                peer.missed += 1
                if peer.missed >= self.config.heartbeat_max_missed:
                    with self._lock:
                        self._drop_peer(peer, TransferFailure(FailureKind.PEER_LOST, f"prefill {peer.address} declared "
                                                              f"dead: {peer.missed} heartbeats missed ({e})"))
                continue
            peer.missed = 0
            if not resp.decode_registered:
                with self._lock:
                    self._drop_peer(peer, TransferFailure(FailureKind.PEER_LOST, f"prefill {peer.address} no longer knows "
                                                          "this decode engine (restarted or timed us out)"))

    # ---- helpers, under _lock ----
    def _rooms_at(self, address: str) -> list[ReceiverRoom]:
        return [r for r in self._rooms.values() if r.address == address]

    def _drop_peer(self, peer: PrefillPeer, failure: TransferFailure) -> None:
        logger.warning(failure.message)
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]
        for room in self._rooms_at(peer.address):
            self._finish(room, failure, tell_prefill=False)
        peer.client.close()

    def _finish(self, room: ReceiverRoom, failure: TransferFailure, tell_prefill: bool) -> None:
        if not room.fail(failure):
            return
        if self._rooms.get(room.room) is room:
            del self._rooms[room.room]
        logger.warning("room %d failed (%s): %s", room.room, failure.kind, failure.message)
        peer = self._peers.get(room.address)
        # AbortRoom needs no registration: an abort racing our own registration must still reach the prefill.
        if tell_prefill and peer is not None:
            self._rpc.submit(self._abort_quietly, peer, room.room, failure)

    def close(self) -> None:
        with self._lock:
            for room in list(self._rooms.values()):
                self._finish(room, TransferFailure(FailureKind.SHUTDOWN, "decode KV manager shut down"), tell_prefill=True)
        self._rpc.shutdown(wait=True, cancel_futures=False)
        for peer in list(self._peers.values()):
            peer.client.close()
