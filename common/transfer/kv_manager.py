"""KVManager (one per worker process) and the per-room KVSender (prefill) / KVReceiver (decode)."""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Sequence

import torch

from common.transfer.messages import ROLES, KVLayout, KVPoll, KVTransferMetadata, TransferConfig
from common.transfer.nixl_backend import NixlBackend

logger = logging.getLogger(__name__)
_IDLE_POLL_S = 0.05


class KVManager:
    """Owns the NIXL agent (pool registered once) and the background threads of one worker:
    the transfer thread (all NIXL calls), and per role the bootstrap server (prefill) or the
    heartbeat thread (decode). The scheduler only touches KVSender/KVReceiver, which never block."""

    def __init__(self, role: str, layout: KVLayout, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor],
                 config: TransferConfig | None = None):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        layout.check_buffers(list(k_buffers), list(v_buffers))
        self.role, self.layout = role, layout
        self.config = config or TransferConfig()
        agent_name = f"{role}-{self.config.engine_id}-{uuid.uuid4().hex[:8]}"
        self.backend = NixlBackend(agent_name, layout, list(k_buffers), list(v_buffers),
                                   progress_thread=self.config.nixl_progress_thread)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._server = None
        self.bootstrap_port: int | None = None
        if role == "prefill":
            from common.transfer.bootstrap_server import start_bootstrap_server
            from common.transfer.prefill_side import PrefillSide

            self.prefill = PrefillSide(self.backend, self.config, self._wake)
            self._side = self.prefill
            self._server, self.bootstrap_port = start_bootstrap_server(
                self.prefill, self.config.bootstrap_host, self.config.bootstrap_port)
        else:
            from common.transfer.decode_side import DecodeSide

            self.decode = DecodeSide(self.backend, self.config, self._wake)
            self._side = self.decode
            self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="kv-heartbeat", daemon=True)
            self._heartbeat.start()
        self._thread = threading.Thread(target=self._transfer_loop, name=f"kv-transfer-{role}", daemon=True)
        self._thread.start()

    @property
    def agent_name(self) -> str:
        return self.backend.agent_name

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

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.config.heartbeat_interval_s):
            try:
                self.decode.heartbeat_once()
            except Exception:
                logger.exception("heartbeat failed")

    def close(self) -> None:
        """Fail every open room (telling peers), stop threads, release NIXL memory."""
        if self._stop.is_set():
            return
        self._side.close()
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        if self._server is not None:
            self._server.stop(grace=0.5).wait()
        self.backend.close()

    def __enter__(self) -> KVManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class KVSender:
    """Prefill side of one room: push the room's KV pages chunk by chunk into decode's pool."""

    def __init__(self, manager: KVManager, room: int, request_id: str = ""):
        if manager.role != "prefill":
            raise ValueError("KVSender needs a prefill KVManager")
        self._prefill = manager.prefill
        self.room = room
        self._state = self._prefill.add_sender(room, request_id)

    def poll(self) -> KVPoll:
        return self._state.state

    def send(self, page_indices: Sequence[int] | torch.Tensor, is_last: bool,
             metadata: KVTransferMetadata | None = None) -> None:
        """Queue the next pages of the prompt (prefill page indices, in prompt order; full pages
        except in the last chunk). With is_last, `metadata` reaches decode after the last WRITE."""
        if isinstance(page_indices, torch.Tensor):
            page_indices = page_indices.cpu().numpy()
        self._prefill.send(self._state, page_indices, is_last, metadata)

    def abort(self, reason: str = "aborted") -> None:
        self._prefill.abort(self._state, reason)

    def failure_reason(self) -> str | None:
        return self._state.reason


class KVReceiver:
    """Decode side of one room: tell the prefill where to write, then wait for the pages."""

    def __init__(self, manager: KVManager, room: int, bootstrap_host: str, bootstrap_port: int):
        if manager.role != "decode":
            raise ValueError("KVReceiver needs a decode KVManager")
        self._decode = manager.decode
        self.room = room
        self._state = self._decode.add_receiver(room, bootstrap_host, bootstrap_port)

    def init(self, dst_page_indices: Sequence[int] | torch.Tensor, prefix_tokens: int = 0, request_id: str = "") -> None:
        """dst_page_indices: decode pages of the WHOLE prompt in order; the first
        prefix_tokens // page_size of them (decode's cached prefix) are not written."""
        if isinstance(dst_page_indices, torch.Tensor):
            dst_page_indices = dst_page_indices.cpu().tolist()
        self._decode.init(self._state, dst_page_indices, prefix_tokens, request_id)

    def poll(self) -> KVPoll:
        return self._state.state

    def metadata(self) -> KVTransferMetadata | None:
        return self._state.metadata if self._state.state == KVPoll.Success else None

    def abort(self, reason: str = "aborted") -> None:
        self._decode.abort(self._state, reason)

    def failure_reason(self) -> str | None:
        return self._state.reason
