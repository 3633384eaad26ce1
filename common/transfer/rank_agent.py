"""The KV transfer on a tensor-parallel rank other than 0 of a prefill or decode worker: its own NIXL agent over its
pool shard, and on a prefill a thread that runs rank 0's write commands (WRITE this rank's heads of a room's pages
into the decode ranks its plan names) and reports each room's outcome to rank 0 as a NIXL notification.

A decode follower does no per-room work: rank 0 allocates the pages and every rank's pool uses the same page
indices, so the prefill ranks write straight into this rank's pool."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from tandem.common.proto_gen.tandem import bootstrap_pb2 as pb
from tandem.common.transfer.messages import KVLayout
from tandem.common.transfer.nixl_backend import NixlBackend
from tandem.common.transfer.rank_plan import RankWrite, Target, rank_writes

logger = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.05
DECODE_PROGRESS_S = 0.01  # a decode follower polls its NIXL worker this often
ORPHAN_GIVE_UP_S = 600.0  # a WRITE of a dropped room still in progress this long is stuck for good (peer gone)


@dataclass
class _Room:
    handles: list = field(default_factory=list)
    last: bool = False


class FollowerAgent:
    """Owns a follower's NixlBackend; on a prefill, the writer thread makes every NIXL call after start-up."""

    def __init__(self, setup: pb.RankAgentSetup, rank: int, kv_pool, head_start: int):
        self.rank = rank
        self.role = setup.role
        self.layout = KVLayout.of_pool(kv_pool)
        name = f"{setup.role}-{setup.engine_id}-rank{rank}-{time.monotonic_ns() % 10**8:08d}"
        self.backend = NixlBackend(name, self.layout, kv_pool.k_buffers, kv_pool.v_buffers, threads=setup.nixl_threads)
        self.pool = pb.RankPool(rank=rank, agent_name=name, agent_metadata=self.backend.metadata,
                                layout=self.backend.layout_proto(), kv_head_start=head_start)
        self._poll_s = setup.poll_interval_s or 0.002
        self._commands: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        if setup.role == "prefill":
            self._leader = self.backend.add_remote(setup.leader_agent_metadata)
            self._targets: dict[str, list[RankWrite] | str] = {}  # engine id -> writes, or why it cannot be written
            self._agents: dict[str, list[str]] = {}  # engine id -> remote agents added for it
            self._rooms: dict[int, _Room] = {}
            self._orphans: list = []  # (handle, since)
            self._thread = threading.Thread(target=self._loop, name=f"kv-rank{rank}", daemon=True)
        else:
            # Without NIXL's progress thread, UCX answers a writer's connection set-up only while someone polls
            # this agent's worker: a decode follower has nothing else to poll, so a thread does, lazily.
            self._thread = threading.Thread(target=self._progress_only, name=f"kv-rank{rank}", daemon=True)
        self._thread.start()

    def submit(self, command: pb.RankCommand) -> None:
        if self.role != "prefill":
            raise RuntimeError(f"rank {self.rank} ({self.role}) received a KV command; only prefill ranks write")
        self._commands.put(command)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.backend.close()

    def _progress_only(self) -> None:
        while not self._stop.wait(DECODE_PROGRESS_S):
            for agent_name, _ in self.backend.new_notifications():
                logger.debug("unexpected notification from %s dropped", agent_name)

    # ---- writer thread ----
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                wait = self._poll_s if (self._rooms or self._orphans) else _IDLE_WAIT_S
                self._apply(self._commands.get(timeout=wait))
                while True:
                    self._apply(self._commands.get_nowait())
            except queue.Empty:
                pass
            try:
                self._progress()
            except Exception:  # a bug here must not silently stall every room
                logger.exception("rank %d KV writer step failed", self.rank)

    def _apply(self, command: pb.RankCommand) -> None:
        body = command.WhichOneof("body")
        if body == "add_decode":
            self._add_decode(command.add_decode)
        elif body == "remove_decode":
            for agent in self._agents.pop(command.remove_decode.engine_id, []):
                self.backend.remove_remote(agent)
            self._targets.pop(command.remove_decode.engine_id, None)
        elif body == "write":
            self._write(command.write)
        elif body == "drop":
            self._drop(command.drop.room)

    def _add_decode(self, msg: pb.AddDecode) -> None:
        plan = next((p for p in msg.plans if p.prefill_rank == self.rank), None)
        targets = [Target.from_proto(t) for t in plan.targets] if plan is not None else []
        for agent in self._agents.pop(msg.engine_id, []):  # a re-registration replaces the old agents
            self.backend.remove_remote(agent)
        agents: list[str] = []

        def add_remote(metadata: bytes) -> str:
            agents.append(self.backend.add_remote(metadata))
            return agents[-1]

        try:
            self._targets[msg.engine_id] = rank_writes(targets, self.layout.num_kv_heads, add_remote)
        except Exception as e:  # reported with each room for this engine
            logger.warning("rank %d cannot add decode %s: %s", self.rank, msg.engine_id, e)
            self._targets[msg.engine_id] = f"rank {self.rank} cannot reach decode {msg.engine_id}: {e}"
        self._agents[msg.engine_id] = agents

    def _write(self, msg: pb.WriteChunk) -> None:
        writes = self._targets.get(msg.engine_id, f"rank {self.rank} does not know decode {msg.engine_id}")
        if isinstance(writes, str):
            self._report(msg.room, writes)
            return
        if not writes:  # this rank holds no head the decode takes from it
            return
        room = self._rooms.setdefault(msg.room, _Room())
        src = np.asarray(msg.src_pages, dtype=np.int64)
        dst = np.asarray(msg.dst_pages, dtype=np.int64)
        try:
            if len(src):
                room.handles.extend(w.post(self.backend, src, dst) for w in writes)
        except Exception as e:
            self._drop(msg.room)
            self._report(msg.room, f"rank {self.rank}: KV WRITE failed: {e}")
            return
        room.last |= msg.is_last

    def _progress(self) -> None:
        for room_id, room in list(self._rooms.items()):
            still, error = [], False
            for handle in room.handles:
                state = self.backend.state(handle)
                if state == "PROC":
                    still.append(handle)
                else:
                    error |= state == "ERR" or not self.backend.release(handle)
            room.handles = still
            if error:
                self._drop(room_id)
                self._report(room_id, f"rank {self.rank}: NIXL WRITE reported an error")
            elif room.last and not still:
                del self._rooms[room_id]
                self._report(room_id, None)
        now = time.monotonic()
        kept = []
        for handle, since in self._orphans:
            if self.backend.state(handle) != "PROC":
                self.backend.release(handle)
            elif now - since < ORPHAN_GIVE_UP_S:
                kept.append((handle, since))
        self._orphans = kept
        self.backend.new_notifications()  # progress UCX's queued sends (our reports)

    def _drop(self, room_id: int) -> None:
        room = self._rooms.pop(room_id, None)
        if room is not None:
            self._orphans.extend((h, time.monotonic()) for h in room.handles)

    def _report(self, room_id: int, error: str | None) -> None:
        report = pb.RankReport(room=room_id, rank=self.rank, ok=error is None, error=error or "")
        try:
            self.backend.notify(self._leader, report.SerializeToString())
        except Exception as e:  # rank 0 then times the room out
            logger.warning("rank %d cannot report room %d to rank 0: %s", self.rank, room_id, e)
