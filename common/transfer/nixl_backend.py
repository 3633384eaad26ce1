"""NIXL (UCX backend) wrapper: registers a KV pool once and WRITEs page runs into a peer's pool."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from common.proto_gen.tandem import bootstrap_pb2 as pb
from common.transfer.messages import KVLayout

logger = logging.getLogger(__name__)


def _nixl():
    import nixl_cu12  # the wheel's module name; imported lazily so that importing Tandem stays cheap

    return nixl_cu12


def _region(tensor: torch.Tensor) -> tuple[int, int, int]:
    device_id = tensor.get_device()
    return tensor.data_ptr(), tensor.numel() * tensor.element_size(), max(device_id, 0)


@dataclass(frozen=True)
class RemotePool:
    """What a WRITE needs to know about a peer's pool: its agent and per-layer base addresses."""

    agent_name: str
    mem_type: str
    device_id: int
    k_bases: np.ndarray  # uint64 [num_layers]
    v_bases: np.ndarray

    @classmethod
    def from_proto(cls, agent_name: str, layout: pb.KVLayout) -> RemotePool:
        return cls(agent_name, layout.mem_type or "DRAM",
                   layout.k_regions[0].device_id if layout.k_regions else 0,
                   np.array([r.address for r in layout.k_regions], dtype=np.uint64),
                   np.array([r.address for r in layout.v_regions], dtype=np.uint64))


def page_runs(src_pages: np.ndarray, dst_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge page pairs into runs contiguous on both sides: (src_starts, dst_starts, lengths)."""
    if len(src_pages) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(src_pages) != 1) | (np.diff(dst_pages) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(src_pages)])))
    return src_pages[starts], dst_pages[starts], lengths


def _ucx_params(threads: int) -> dict[str, str]:
    """UCX backend parameters. With threads, NIXL's UCX thread pool splits a WRITE's descriptor list between
    them, but only lists of at least `split_batch_size` descriptors (default 1024); a WRITE here has
    2 * layers * runs descriptors (16 for a contiguous prompt of an 8-layer model), so it must split from
    one descriptor per thread, else the threads never share a WRITE."""
    if threads <= 0:
        return {}
    return {"num_threads": str(threads), "split_batch_size": "1"}


class NixlBackend:
    """Owns one NIXL agent. Not thread-safe: the KVManager calls it from its transfer thread only
    (construction, `metadata` and `layout_proto` excepted)."""

    def __init__(self, agent_name: str, layout: KVLayout, k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor],
                 progress_thread: bool = False, threads: int = 0):
        nixl = _nixl()
        self.agent_name = agent_name
        self.layout = layout
        self.mem_type = "VRAM" if k_buffers[0].is_cuda else "DRAM"
        self.agent = nixl.nixl_agent(agent_name, nixl.nixl_agent_config(enable_prog_thread=progress_thread, backends=[]))
        self.agent.create_backend("UCX", _ucx_params(threads))
        self._k_regions = [_region(t) for t in k_buffers]
        self._v_regions = [_region(t) for t in v_buffers]
        self._device_id = self._k_regions[0][2]
        # Registered once per process; every later WRITE addresses sub-ranges of these regions.
        self._registered = self.agent.register_memory(list(k_buffers) + list(v_buffers))
        self._k_bases = np.array([r[0] for r in self._k_regions], dtype=np.uint64)
        self._v_bases = np.array([r[0] for r in self._v_regions], dtype=np.uint64)
        self.metadata: bytes = self.agent.get_agent_metadata()

    def layout_proto(self) -> pb.KVLayout:
        lay = self.layout
        return pb.KVLayout(
            num_layers=lay.num_layers, page_size=lay.page_size, num_kv_heads=lay.num_kv_heads,
            head_dim=lay.head_dim, dtype=lay.dtype, num_pages=lay.num_pages, mem_type=self.mem_type,
            k_regions=[pb.MemoryRegion(address=a, length=n, device_id=d) for a, n, d in self._k_regions],
            v_regions=[pb.MemoryRegion(address=a, length=n, device_id=d) for a, n, d in self._v_regions])

    def add_remote(self, metadata: bytes) -> str:
        name = self.agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else name

    def remove_remote(self, agent_name: str) -> None:
        try:
            self.agent.remove_remote_agent(agent_name)
        except Exception as e:  # already gone is fine
            logger.debug("remove_remote_agent(%s): %s", agent_name, e)

    def write_pages(self, remote: RemotePool, src_pages: np.ndarray, dst_pages: np.ndarray):
        """Post one WRITE of the given pages of every layer's K and V; returns the NIXL handle."""
        src_starts, dst_starts, lengths = page_runs(src_pages, dst_pages)
        page_bytes = np.uint64(self.layout.page_bytes)
        src_off = src_starts.astype(np.uint64) * page_bytes
        dst_off = dst_starts.astype(np.uint64) * page_bytes
        nbytes = lengths.astype(np.uint64) * page_bytes
        local_bases = np.concatenate((self._k_bases, self._v_bases))
        remote_bases = np.concatenate((remote.k_bases, remote.v_bases))
        local = _descs(local_bases[:, None] + src_off[None, :], nbytes, self._device_id)
        remote_descs = _descs(remote_bases[:, None] + dst_off[None, :], nbytes, remote.device_id)
        handle = self.agent.initialize_xfer(
            "WRITE", self.agent.get_xfer_descs(local, self.mem_type),
            self.agent.get_xfer_descs(remote_descs, remote.mem_type), remote.agent_name)
        if self.agent.transfer(handle) == "ERR":
            self.release(handle)
            raise RuntimeError(f"NIXL refused to post a WRITE to {remote.agent_name}")
        return handle

    def state(self, handle) -> str:
        """'DONE', 'PROC' or 'ERR' (NIXL raises for some failures, e.g. a disconnected peer)."""
        try:
            return self.agent.check_xfer_state(handle)
        except Exception as e:
            logger.info("transfer failed: %s", e)
            return "ERR"

    def release(self, handle) -> bool:
        try:
            self.agent.release_xfer_handle(handle)
            return True
        except Exception as e:  # still active: the caller retries later
            logger.debug("release_xfer_handle: %s", e)
            return False

    def notify(self, agent_name: str, payload: bytes) -> None:
        """Standalone notification; raises if the peer is unknown or unreachable."""
        self.agent.send_notif(agent_name, payload)

    def new_notifications(self) -> list[tuple[str, bytes]]:
        out = []
        for agent_name, messages in self.agent.get_new_notifs().items():
            name = agent_name.decode() if isinstance(agent_name, bytes) else agent_name
            out.extend((name, m) for m in messages)
        return out

    def close(self) -> None:
        try:
            self.agent.deregister_memory(self._registered)
        except Exception as e:
            logger.debug("deregister_memory: %s", e)


def _descs(addresses: np.ndarray, nbytes: np.ndarray, device_id: int) -> np.ndarray:
    """Nx3 (address, length, device) rows: layer-major, run-minor."""
    rows = addresses.reshape(-1)
    out = np.empty((len(rows), 3), dtype=np.uint64)
    out[:, 0] = rows
    out[:, 1] = np.broadcast_to(nbytes[None, :], addresses.shape).reshape(-1)
    out[:, 2] = device_id
    return out
