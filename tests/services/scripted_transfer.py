"""In-process PD scheduler tests' rig: a real engine whose prefill or decode scheduler is stepped by the test, one
loop iteration at a time, while a scripted transfer side (in place of NIXL and the bootstrap server) says what each
room's KVSender/KVReceiver polls."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator, Optional

import numpy as np

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.roles import Role
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import AbortRequest, GenerateRequest, TokenOutput
from tandem.common.scheduler.loop import Inbox
from tandem.common.telemetry.metrics import WorkerMetrics
from tandem.common.transfer.failures import FailureKind, TransferFailure
from tandem.common.transfer.messages import KVPoll, KVTransferMetadata, RoomState

PAGE = 4
BOOTSTRAP = ("127.0.0.1", 1)  # never dialled: the scripted side answers for the prefill


def pd_config(model_dir: str, **overrides) -> EngineConfig:
    return EngineConfig(model_path=model_dir, page_size=PAGE, event_loop="normal", max_context_len=512,
                        **{"max_total_tokens": 256, **overrides})


@dataclasses.dataclass
class Chunk:
    pages: list[int]
    is_last: bool
    metadata: Optional[KVTransferMetadata]


class ScriptedSide:
    """Stands in for PrefillSide and DecodeSide under the real KVSender/KVReceiver: every room starts
    Bootstrapping and moves only when the test says so. Like the real sides, a finished room ignores later sends
    and aborts (the first outcome wins)."""

    def __init__(self):
        self.rooms: dict[int, RoomState] = {}
        self.chunks: dict[int, list[Chunk]] = {}  # prefill: what each room was asked to WRITE
        self.inits: dict[int, tuple[list[int], int]] = {}  # decode: (destination pages, prefix tokens)
        self.aborts: dict[int, str] = {}  # rooms the scheduler aborted, and why

    # ---- what the KVSender / KVReceiver call ----
    def add_sender(self, room_id: int, request_id: str) -> RoomState:
        return self._open(room_id)

    def add_receiver(self, room_id: int, host: str, port: int) -> RoomState:
        return self._open(room_id)

    def _open(self, room_id: int) -> RoomState:
        assert room_id not in self.rooms, f"room {room_id} opened twice"
        self.rooms[room_id] = room = RoomState(room=room_id)
        self.chunks[room_id] = []
        return room

    def send(self, room: RoomState, src_pages, is_last: bool, metadata: Optional[KVTransferMetadata]) -> None:
        if not room.state.terminal:
            self.chunks[room.room].append(Chunk([int(p) for p in np.asarray(src_pages).reshape(-1)], is_last,
                                                metadata))

    def init(self, room: RoomState, dst_pages, prefix_tokens: int, request_id: str) -> None:
        assert room.room not in self.inits, f"room {room.room} given pages twice"
        self.inits[room.room] = ([int(p) for p in dst_pages], int(prefix_tokens))

    def abort(self, room: RoomState, reason: str) -> None:
        if room.fail(TransferFailure(FailureKind.ABORTED, f"aborted: {reason}")):
            self.aborts[room.room] = reason

    # ---- what the test scripts ----
    def to(self, room_id: int, state: KVPoll) -> None:
        self.rooms[room_id].state = state

    def fail(self, room_id: int, kind: FailureKind) -> None:
        assert self.rooms[room_id].fail(TransferFailure(kind, f"scripted {kind.value}"))

    def succeed(self, room_id: int, metadata: Optional[KVTransferMetadata] = None) -> None:
        room = self.rooms[room_id]
        room.metadata, room.state = metadata, KVPoll.Success

    def pages_sent(self, room_id: int) -> list[int]:
        return [p for chunk in self.chunks[room_id] for p in chunk.pages]


class ScriptedKVManager:
    """What a PD scheduler and its KVSender/KVReceiver use of a KV manager, over one ScriptedSide."""

    def __init__(self, side: ScriptedSide):
        self.prefill = self.decode = side
        self.layout = dataclasses.make_dataclass("Layout", ["page_size"])(PAGE)
        self.closed = False

    def kv_bytes(self, pages: int) -> int:
        return 1000 * pages

    def close(self) -> None:
        self.closed = True


@dataclasses.dataclass
class Rig:
    """A PD scheduler on a real engine's model and pools, its scripted transfer, and every output it streamed."""

    engine: Engine
    scheduler: object
    side: ScriptedSide
    metrics: WorkerMetrics
    outputs: dict[str, list[TokenOutput]]

    def step(self, *msgs) -> None:
        """One iteration of the scheduler's normal event loop, after `msgs` reached its inbox."""
        for msg in msgs:
            self.scheduler.inbox.put(msg)
        self.scheduler.inbox.put(Inbox.STOP)  # ends the loop after this iteration
        self.scheduler.stopped = False
        self.scheduler.event_loop_normal()

    def submit(self, rid: str, room: int, input_ids: list[int], max_new_tokens: int = 6) -> None:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        self.step(GenerateRequest(rid, input_ids, params, bootstrap_host=BOOTSTRAP[0], bootstrap_port=BOOTSTRAP[1],
                                  bootstrap_room=room))

    def abort(self, rid: str) -> None:
        self.step(AbortRequest(rid, "client went away"))

    def queues(self) -> dict:
        """The non-empty queues (queue_sizes)."""
        return {name: n for name, n in self.scheduler.queue_sizes().items() if n}

    def finished(self, rid: str) -> Optional[TokenOutput]:
        """The request's last output, if it ended."""
        outs = self.outputs.get(rid, [])
        return outs[-1] if outs and outs[-1].finished else None

    def tokens(self, rid: str) -> list[int]:
        return [t for out in self.outputs.get(rid, []) for t in out.token_ids]

    def failures(self, reason: str) -> float:
        role = self.metrics.role
        return self.metrics.registry.get_sample_value("tandem_kv_transfer_failures_total",
                                                      {"role": str(role), "reason": reason}) or 0.0

    def transfers_done(self) -> float:
        return self.metrics.registry.get_sample_value("tandem_kv_transfer_pages_total",
                                                      {"role": str(self.metrics.role)}) or 0.0

    def free_tokens(self) -> int:
        """KV tokens that are free or only cached (evictable): what a new request can have."""
        return self.scheduler.ops.available_tokens()

    def assert_pool_whole(self) -> None:
        """Every KV page is free or cached unlocked, every request slot free: nothing held, nothing leaked."""
        ops = self.scheduler.ops
        tree = ops.tree_cache
        assert tree.protected_size() == 0
        assert ops.allocator.available_size() + tree.evictable_size() == self.engine.max_total_tokens
        assert ops.req_to_token_pool.available_size() == ops.req_to_token_pool.size


@contextlib.contextmanager
def scheduler_rig(config: EngineConfig, role: Role, make: Callable[[object, ScriptedKVManager], object]
                  ) -> Iterator[Rig]:
    """An engine whose scheduler thread exits at once: the test thread steps the scheduler (`Rig.step`)."""
    side = ScriptedSide()
    metrics = WorkerMetrics(role)
    outputs: dict[str, list[TokenOutput]] = {}

    def sink(outs: list[TokenOutput]) -> None:
        for out in outs:
            outputs.setdefault(out.rid, []).append(out)

    def factory(parts):
        scheduler = make(dataclasses.replace(parts, sink=sink, metrics=metrics), ScriptedKVManager(side))
        scheduler.stopped = True  # the engine's thread runs no iteration; the test runs them
        return scheduler

    with Engine(config, scheduler_factory=factory, metrics=metrics, can_release_kv=False) as engine:
        engine._thread.join(5)  # its loop returned at once; from here only the test thread touches the scheduler
        assert not engine._thread.is_alive()
        yield Rig(engine, engine.scheduler, side, metrics, outputs)


def copy_pages(src: Engine, src_pages: list[int], dst: Engine, dst_pages: list[int]) -> None:
    """What the prefill's NIXL WRITEs do: each source page's K and V, every layer, into its destination page."""
    def rows(pages: list[int]) -> np.ndarray:
        return (np.asarray(pages)[:, None] * PAGE + np.arange(PAGE)).reshape(-1)

    src_rows, dst_rows = rows(src_pages), rows(dst_pages)
    for buffers in ("k_buffers", "v_buffers"):
        for s, d in zip(getattr(src.kv_pool, buffers), getattr(dst.kv_pool, buffers)):
            d[dst_rows] = s[src_rows]


def reference_tokens(model_dir: str, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of a unified engine (what a prefill/decode pair must produce)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    with Engine(pd_config(model_dir)) as engine:
        [result] = engine.generate([GenerateRequest("ref", input_ids, params)])
    return result.sequences[0].output_ids
