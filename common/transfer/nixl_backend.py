"""NIXL (UCX backend) wrapper: registers a KV pool once and WRITEs pages into a peer's pool."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from tandem.common.proto_gen.tandem import bootstrap_pb2 as pb
from tandem.common.transfer.messages import KVLayout

logger = logging.getLogger(__name__)


def _nixl():
    import nixl_cu12  # the wheel's module name; imported lazily so that importing Tandem stays cheap

    return nixl_cu12


def _region(tensor: torch.Tensor) -> tuple[int, int, int]:
    device_id = tensor.get_device()
    return tensor.data_ptr(), tensor.numel() * tensor.element_size(), max(device_id, 0)


@dataclass(frozen=True)
class RemotePool:
    """What a WRITE needs to know about a peer's pool: its agent, per-layer base addresses and size."""

    agent_name: str
    mem_type: str
    device_id: int
    k_bases: np.ndarray  # uint64 [num_layers]
    v_bases: np.ndarray
    num_pages: int  # pages per layer buffer, padding page 0 included

    @classmethod
    def from_proto(cls, agent_name: str, layout: pb.KVLayout) -> RemotePool:
        return cls(agent_name, layout.mem_type or "DRAM",
                   layout.k_regions[0].device_id if layout.k_regions else 0,
                   np.array([r.address for r in layout.k_regions], dtype=np.uint64),
                   np.array([r.address for r in layout.v_regions], dtype=np.uint64), layout.num_pages)


def _page_dlist(k_bases: np.ndarray, v_bases: np.ndarray, page_bytes: int, num_pages: int, device_id: int) -> np.ndarray:
    """A pool as NIXL's strided descriptor list (Nx5: address, length, device, stride, count): one row per K then
    V buffer, `num_pages` page descriptors each, so descriptor `buffer * num_pages + page` is that page."""
    bases = np.concatenate((k_bases, v_bases))
    rows = np.empty((len(bases), 5), dtype=np.uint64)
    rows[:, 0] = bases
    rows[:, 1] = rows[:, 3] = page_bytes
    rows[:, 2] = device_id
    rows[:, 4] = num_pages
    return rows


def _page_indices(pages: np.ndarray, num_buffers: int, num_pages: int, side: str) -> np.ndarray:
    """Descriptor indices of `pages` in every buffer of a `_page_dlist`, buffer-major. NIXL merges indices
    that are consecutive on both sides, so a run of pages contiguous in both pools is one copy per buffer."""
    if len(pages) and (pages.min() < 0 or pages.max() >= num_pages):
        raise ValueError(f"{side} pages must lie in [0, {num_pages}), got {pages.min()}..{pages.max()}")
    first = np.arange(num_buffers, dtype=np.int64)[:, None] * num_pages
    return (first + pages[None, :]).reshape(-1).astype(np.int32)


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
        try:
            self._registered = self.agent.register_memory(list(k_buffers) + list(v_buffers))
        except Exception as e:
            if self.mem_type == "VRAM":
                raise RuntimeError(
                    f"NIXL could not register the KV pool in GPU memory ({e}): the nixl-cu12 wheel's UCX needs CUDA "
                    "12's runtime (libcudart.so.12) to see GPU memory; install nvidia-cuda-runtime-cu12 and put its "
                    "nvidia/cuda_runtime/lib folder on LD_LIBRARY_PATH") from e
            raise
        self._k_bases = np.array([r[0] for r in self._k_regions], dtype=np.uint64)
        self._v_bases = np.array([r[0] for r in self._v_regions], dtype=np.uint64)
        # Pre-registered descriptor lists: the pool's pages here and, once per peer, the peer's pages; a WRITE
        # then names pages by index instead of having NIXL build and validate a descriptor list each time.
        self._local_pages = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", _page_dlist(
            self._k_bases, self._v_bases, layout.page_bytes, layout.num_pages, self._device_id), self.mem_type)
        self._remote_pages: dict[str, object] = {}  # agent name -> prepped list of its pool's pages
        self.metadata: bytes = self.agent.get_agent_metadata()

    def layout_proto(self) -> pb.KVLayout:
        lay = self.layout
        return pb.KVLayout(
            num_layers=lay.num_layers, page_size=lay.page_size, num_kv_heads=lay.num_kv_heads,
            head_dim=lay.head_dim, dtype=lay.dtype, num_pages=lay.num_pages, mem_type=self.mem_type,
            k_scales=lay.k_scales, v_scales=lay.v_scales,
            k_regions=[pb.MemoryRegion(address=a, length=n, device_id=d) for a, n, d in self._k_regions],
            v_regions=[pb.MemoryRegion(address=a, length=n, device_id=d) for a, n, d in self._v_regions])

    def add_remote(self, metadata: bytes) -> str:
        name = self.agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else name

    def remove_remote(self, agent_name: str) -> None:
        remote_pages = self._remote_pages.pop(agent_name, None)
        if remote_pages is not None:
            self.agent.release_dlist_handle(remote_pages)
        try:
            self.agent.remove_remote_agent(agent_name)
        except Exception as e:  # already gone is fine
            logger.debug("remove_remote_agent(%s): %s", agent_name, e)

    def write_pages(self, remote: RemotePool, src_pages: np.ndarray, dst_pages: np.ndarray):
        """Post one WRITE of the given pages of every layer's K and V; returns the NIXL handle."""
        num_buffers = 2 * self.layout.num_layers
        handle = self.agent.make_prepped_xfer(
            "WRITE", self._local_pages, _page_indices(src_pages, num_buffers, self.layout.num_pages, "source"),
            self._peer_pages(remote), _page_indices(dst_pages, num_buffers, remote.num_pages, "destination"))
        if self.agent.transfer(handle) == "ERR":
            self.release(handle)
            raise RuntimeError(f"NIXL refused to post a WRITE to {remote.agent_name}")
        return handle

    def write_head_slices(self, remote: RemotePool, remote_heads: int, src_pages: np.ndarray, dst_pages: np.ndarray,
                          slices) -> object:
        """Post one WRITE of some heads of the given pages (every layer's K and V) into a pool that holds other heads
        (a peer at another tensor-parallel size). `slices`: (src_head, dst_head, count) in local head indices of
        each pool; a head range of one token row is contiguous ([token][head][dim]), so each (token row, slice) is
        one descriptor."""
        lay = self.layout
        head_bytes = lay.head_dim * getattr(torch, lay.dtype).itemsize
        tokens = np.arange(lay.page_size, dtype=np.uint64)
        src_rows = (src_pages.astype(np.uint64)[:, None] * np.uint64(lay.page_size) + tokens).reshape(-1)
        dst_rows = (dst_pages.astype(np.uint64)[:, None] * np.uint64(lay.page_size) + tokens).reshape(-1)
        src_head = np.array([s[0] for s in slices], dtype=np.uint64)
        dst_head = np.array([s[1] for s in slices], dtype=np.uint64)
        counts = np.array([s[2] for s in slices], dtype=np.uint64)
        # Offsets [rows, slices] within one layer's buffer, flattened row-major.
        src_off = ((src_rows[:, None] * np.uint64(lay.num_kv_heads) + src_head) * np.uint64(head_bytes)).reshape(-1)
        dst_off = ((dst_rows[:, None] * np.uint64(remote_heads) + dst_head) * np.uint64(head_bytes)).reshape(-1)
        nbytes = np.broadcast_to(counts * np.uint64(head_bytes), (len(src_rows), len(slices))).reshape(-1)
        local_bases = np.concatenate((self._k_bases, self._v_bases))
        remote_bases = np.concatenate((remote.k_bases, remote.v_bases))
        local = _descs(local_bases[:, None] + src_off[None, :], nbytes, self._device_id)
        remote_descs = _descs(remote_bases[:, None] + dst_off[None, :], nbytes, remote.device_id)
        return self._post_write(local, remote_descs, remote)

    def _post_write(self, local: np.ndarray, remote_descs: np.ndarray, remote: RemotePool):
        handle = self.agent.initialize_xfer(
            "WRITE", self.agent.get_xfer_descs(local, self.mem_type),
            self.agent.get_xfer_descs(remote_descs, remote.mem_type), remote.agent_name)
        if self.agent.transfer(handle) == "ERR":
            self.release(handle)
            raise RuntimeError(f"NIXL refused to post a WRITE to {remote.agent_name}")
        return handle

    def _peer_pages(self, remote: RemotePool):
        """The peer pool's prepped page list, made on the first WRITE to it."""
        pages = self._remote_pages.get(remote.agent_name)
        if pages is None:
            pages = self.agent.prep_xfer_dlist(remote.agent_name, _page_dlist(
                remote.k_bases, remote.v_bases, self.layout.page_bytes, remote.num_pages, remote.device_id),
                remote.mem_type)
            self._remote_pages[remote.agent_name] = pages
        return pages

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
            for pages in [self._local_pages, *self._remote_pages.values()]:
                self.agent.release_dlist_handle(pages)
            self._remote_pages.clear()
            self.agent.deregister_memory(self._registered)
        except Exception as e:
            logger.debug("deregister_memory: %s", e)



def _descs(addresses: np.ndarray, nbytes: np.ndarray, device_id: int) -> np.ndarray:
    """Nx3 (address, length, device) rows: buffer-major, then the order of `addresses`' second axis."""
    rows = addresses.reshape(-1)
    out = np.empty((len(rows), 3), dtype=np.uint64)
    out[:, 0] = rows
    out[:, 1] = np.broadcast_to(nbytes[None, :], addresses.shape).reshape(-1)
    out[:, 2] = device_id
    return out
