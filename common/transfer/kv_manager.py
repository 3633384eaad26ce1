"""KV managers (one per worker process, one class per side of the transfer) and per-request KVSender/KVReceiver."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

from tandem.common.transfer.bootstrap_server import start_bootstrap_server
from tandem.common.transfer.decode_side import DecodeSide
from tandem.common.transfer.failures import TransferFailure
from tandem.common.transfer.messages import KVLayout, KVPoll, KVTransferMetadata, TransferConfig
from tandem.common.transfer.nixl_backend import NixlBackend
from tandem.common.transfer.prefill_side import PrefillSide
from tandem.common.proto_gen.tandem import bootstrap_pb2 as pb
from tandem.common.transfer.rank_plan import RankPool

logger = logging.getLogger(__name__)
_IDLE_POLL_S = 0.05


class _Side(Protocol):
    """A side's room state, stepped by the manager's transfer thread."""

    def step(self) -> bool: ...
    def has_rooms(self) -> bool: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class KVShard:
    """Which of the model's KV heads this process's pool holds, and (tensor parallelism) the runner that reaches the
    worker's other ranks: `setup_kv_agents` and `send_kv_command` of common/model/parallel/runner.py."""

    heads: range
    total_heads: int
    ranks: Optional[object] = None

    @classmethod
    def of_parts(cls, parts) -> KVShard:
        """From the SchedulerParts the Engine hands a prefill/decode scheduler."""
        return cls(parts.kv_heads, parts.total_kv_heads, parts.tp_runner)


class KVManager:
    """What both sides share: the NIXL agent (pool registered once) and the transfer thread, which makes every
    NIXL call. The scheduler only touches KVSender/KVReceiver, which never block. Under tensor parallelism this is
    rank 0's: every other rank opens its own agent over its pool shard at start-up, and `pools` lists them all."""

    def __init__(self, agent_prefix: str, layout: KVLayout, k_buffers: Sequence[torch.Tensor],
                 v_buffers: Sequence[torch.Tensor], config: TransferConfig | None, shard: KVShard | None):
        layout.check_buffers(list(k_buffers), list(v_buffers))
        self.layout = layout
        self.config = config or TransferConfig()
        self.shard = shard or KVShard(range(layout.num_kv_heads), layout.num_kv_heads)
        if len(self.shard.heads) != layout.num_kv_heads:
            raise ValueError(f"the pool holds {layout.num_kv_heads} KV heads, its shard names {self.shard.heads}")
        agent_name = f"{agent_prefix}-{self.config.engine_id}-{uuid.uuid4().hex[:8]}"
        self.backend = NixlBackend(agent_name, layout, list(k_buffers), list(v_buffers),
                                   progress_thread=self.config.nixl_progress_thread, threads=self.config.nixl_threads)
        own = RankPool(0, agent_name, self.backend.metadata, self.backend.layout_proto(), self.shard.heads)
        self.pools = [own] if self.shard.ranks is None else self._open_rank_agents(agent_prefix, own)
        self._stop = threading.Event()
        self._wake = threading.Event()

    def _open_rank_agents(self, role: str, own: RankPool) -> list[RankPool]:
        """Every other rank opens its NIXL agent over its pool shard; their pools in rank order, rank 0's first."""
        setup = pb.RankAgentSetup(role=role, leader_agent_name=own.agent_name, leader_agent_metadata=own.agent_metadata,
                                  nixl_threads=self.config.nixl_threads, poll_interval_s=self.config.poll_interval_s,
                                  engine_id=self.config.engine_id)
        answers = self.shard.ranks.setup_kv_agents(setup.SerializeToString(), own.to_proto().SerializeToString())
        for rank, answer in enumerate(answers):
            if not answer:
                raise RuntimeError(f"tensor-parallel rank {rank} could not open its NIXL agent (see its log)")
        return [RankPool.from_proto(pb.RankPool.FromString(a)) for a in answers]

    @property
    def agent_name(self) -> str:
        return self.backend.agent_name

    def kv_bytes(self, pages: int) -> int:
        """Bytes of the model's K and V (every KV head, all ranks together) in `pages` pages: what a room moves,
        counted once per head even when several decode ranks hold a replica of it."""
        return self.layout.transfer_bytes(pages) * self.shard.total_heads // self.layout.num_kv_heads

    def _start_transfer_thread(self, side: _Side, name: str) -> None:
        self._side = side
        self._thread = threading.Thread(target=self._transfer_loop, name=name, daemon=True)
        self._thread.start()

    def set_weight_version(self, version: str) -> None:
        """The engine's weights changed: rooms are paired only between a prefill and a decode of one version."""
        self._side.weight_version = version

    def _transfer_loop(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self._side.step()
            except Exception:  # a bug here must not silently stall every room
                logger.exception("KV transfer step failed")
                busy = False
            if not busy:
                # With no open room nothing can arrive, so poll lazily; new work sets _wake.
                self._wake.wait(self.config.poll_interval_s if self._side.has_rooms() else _IDLE_POLL_S)
            self._wake.clear()

    def close(self) -> None:
        """Fail every open room (telling peers), stop threads, release NIXL memory."""
        if self._stop.is_set():
            return
        self._side.close()
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self._close_extra()
        self.backend.close()

    def _close_extra(self) -> None:
        """A side's own servers and threads, stopped after the transfer thread."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PrefillKVManager(KVManager):
    """The sending side: a bootstrap gRPC server that decode workers register with, and the rooms it WRITEs."""

    def __init__(self, layout: KVLayout, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor],
                 config: TransferConfig | None = None, shard: KVShard | None = None):
        super().__init__("prefill", layout, k_buffers, v_buffers, config, shard)
        self.prefill = PrefillSide(self.backend, self.config, self._wake, self.pools, self.shard.total_heads,
                                   self.shard.ranks)
        self._server, self.bootstrap_port = start_bootstrap_server(
            self.prefill, self.config.bootstrap_host, self.config.bootstrap_port, tls=self.config.tls)
        self._start_transfer_thread(self.prefill, "kv-transfer-prefill")

    def _close_extra(self) -> None:
        self._server.stop(grace=0.5).wait()


class DecodeKVManager(KVManager):
    """The receiving side: registrations with prefills, destinations, notifications, and a heartbeat thread."""

    def __init__(self, layout: KVLayout, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor],
                 config: TransferConfig | None = None, shard: KVShard | None = None):
        super().__init__("decode", layout, k_buffers, v_buffers, config, shard)
        self.decode = DecodeSide(self.backend, self.config, self._wake, self.pools, self.shard.total_heads)
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="kv-heartbeat", daemon=True)
        self._heartbeat.start()
        self._start_transfer_thread(self.decode, "kv-transfer-decode")

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.config.heartbeat_interval_s):
            try:
                self.decode.heartbeat_once()
            except Exception:
                logger.exception("heartbeat failed")


class KVSender:
    """Prefill side of one request's transfer (hung on `req.transfer`): its room, the pages queued so far, when
    the first left, and why it failed."""

    def __init__(self, manager: PrefillKVManager, room: int, request_id: str = ""):
        self._prefill = manager.prefill
        self._manager = manager
        self.room = room
        self.pages_sent = 0  # prompt pages queued for WRITE, in prompt order
        self.started_at: Optional[float] = None  # time.monotonic() of the first send
        self._state = self._prefill.add_sender(room, request_id)

    def poll(self) -> KVPoll:
        return self._state.state

    @property
    def failure(self) -> Optional[TransferFailure]:
        return self._state.failure

    @property
    def bytes_sent(self) -> int:
        return self._manager.kv_bytes(self.pages_sent)

    def send(self, page_indices: Sequence[int] | torch.Tensor, is_last: bool,
             metadata: KVTransferMetadata | None = None) -> None:
        """Queue the next pages of the prompt (prefill page indices, in prompt order; full pages
        except in the last chunk). With is_last, `metadata` reaches decode after the last WRITE."""
        if isinstance(page_indices, torch.Tensor):
            page_indices = page_indices.cpu().numpy()
        if self.started_at is None:
            self.started_at = time.monotonic()
        self.pages_sent += len(page_indices)
        self._prefill.send(self._state, page_indices, is_last, metadata)

    def abort(self, reason: str = "aborted") -> None:
        self._prefill.abort(self._state, reason)


class KVReceiver:
    """Decode side of one request's transfer (hung on `req.transfer`): tells the prefill where to write, then
    waits for the pages; knows how many pages it expects, since when, and why it failed."""

    def __init__(self, manager: DecodeKVManager, room: int, bootstrap_host: str, bootstrap_port: int):
        self._decode = manager.decode
        self._manager = manager
        self._layout = manager.layout
        self.room = room
        self.pages_expected = 0  # pages the prefill must WRITE (the decode's cached prefix excluded)
        self.started_at: Optional[float] = None  # time.monotonic() when the destination was set
        self._state = self._decode.add_receiver(room, bootstrap_host, bootstrap_port)

    def init(self, dst_page_indices: Sequence[int] | torch.Tensor, prefix_tokens: int = 0, request_id: str = "") -> None:
        """dst_page_indices: decode pages of the WHOLE prompt in order; the first
        prefix_tokens // page_size of them (decode's cached prefix) are not written."""
        if isinstance(dst_page_indices, torch.Tensor):
            dst_page_indices = dst_page_indices.cpu().tolist()
        self.pages_expected = len(dst_page_indices) - prefix_tokens // self._layout.page_size
        self.started_at = time.monotonic()
        self._decode.init(self._state, dst_page_indices, prefix_tokens, request_id)

    def poll(self) -> KVPoll:
        return self._state.state

    @property
    def failure(self) -> Optional[TransferFailure]:
        return self._state.failure

    @property
    def bytes_expected(self) -> int:
        return self._manager.kv_bytes(self.pages_expected)

    def metadata(self) -> KVTransferMetadata | None:
        return self._state.metadata if self._state.state == KVPoll.Success else None

    def abort(self, reason: str = "aborted") -> None:
        self._decode.abort(self._state, reason)
