"""HiCache's L3 through NIXL's POSIX file plugin: one file per page in a directory workers may share."""

from __future__ import annotations

import os
import re
import threading
import time
import uuid

import numpy as np

from tandem.common.flags import ConfigError
from tandem.common.memory.hicache_storage import PAGE_SUFFIX, StorageBackend  # one layout: file and nixl share a dir

FILE_PLUGIN = "POSIX"
_HEX_KEY = re.compile(r"[0-9a-f]+")


def _nixl():
    try:
        import nixl_cu12  # the wheel's module name
    except ImportError as e:
        raise ConfigError(f"--hicache-storage-backend nixl needs the nixl-cu12 package ({e})") from e
    return nixl_cu12


class NixlFileStorage(StorageBackend):
    """Pages are files `<key>.kvpage` (the file backend's names); a put writes a temporary file through NIXL and renames it into place, so
    readers (here or in another worker on the same directory) see a whole page or none. Recency is the file's
    mtime, stamped on put and on get, so every worker sharing the directory sees one LRU order.

    Thread-safe: one lock serialises the agent and its staging buffer."""

    name = "nixl"

    def __init__(self, directory: str, agent_name: str | None = None):
        nixl = _nixl()
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.agent_name = agent_name or f"hicache-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._agent = nixl.nixl_agent(self.agent_name, nixl.nixl_agent_config(enable_prog_thread=False, backends=[]))
        plugins = self._agent.get_plugin_list()
        if FILE_PLUGIN not in plugins:
            raise ConfigError(f"--hicache-storage-backend nixl needs NIXL's {FILE_PLUGIN} file plugin; this NIXL "
                              f"has {sorted(plugins)} (set NIXL_PLUGIN_DIR or use --hicache-storage-backend file)")
        self._agent.create_backend(FILE_PLUGIN, {})
        self._lock = threading.Lock()
        self._staging = np.empty(0, dtype=np.uint8)
        self._staging_reg = None
        self._last_stamp = 0

    # -- the StorageBackend interface --------------------------------------------------------------------------

    def put(self, key: str, payload: bytes) -> None:
        path = self._path(key)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                if payload:
                    os.ftruncate(fd, len(payload))
                    with self._lock:
                        staging = self._staging_for(len(payload))
                        staging[:len(payload)] = np.frombuffer(payload, dtype=np.uint8)
                        self._transfer("WRITE", len(payload), fd)
            finally:
                os.close(fd)
            stamp = self._stamp()
            os.utime(tmp, ns=(stamp, stamp))
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            payload = b""
            if size:
                with self._lock:
                    staging = self._staging_for(size)
                    self._transfer("READ", size, fd)
                    payload = staging[:size].tobytes()
        finally:
            os.close(fd)
        stamp = self._stamp()
        try:
            os.utime(path, ns=(stamp, stamp))
        except FileNotFoundError:
            pass  # evicted by another worker after we read it: the bytes we hold are still that page
        return payload

    def contains(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def delete(self, key: str) -> None:
        _unlink(self._path(key))

    def keys_by_age(self) -> list[str]:
        return [key for _, key, _ in sorted(self._pages())]

    def bytes_used(self) -> int:
        return sum(size for _, _, size in self._pages())

    def clear(self) -> None:
        for _, key, _ in self._pages():
            self.delete(key)

    def close(self) -> None:
        with self._lock:
            if self._staging_reg is not None:
                self._agent.deregister_memory(self._staging_reg)
                self._staging_reg = None

    # -- internals ---------------------------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        if not _HEX_KEY.fullmatch(key):
            raise ValueError(f"HiCache storage keys are lowercase hex strings, got {key!r}")
        return os.path.join(self.directory, key + PAGE_SUFFIX)

    def _pages(self) -> list[tuple[int, str, int]]:
        """(mtime_ns, key, size) of every page file; files another worker deletes meanwhile are skipped."""
        pages = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if not entry.name.endswith(PAGE_SUFFIX):
                    continue
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                pages.append((st.st_mtime_ns, entry.name[:-len(PAGE_SUFFIX)], st.st_size))
        return pages

    def _stamp(self) -> int:
        """A recency stamp strictly after this instance's previous one (the clock's ticks may be coarse)."""
        self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
        return self._last_stamp

    def _staging_for(self, nbytes: int) -> np.ndarray:
        """The registered host buffer NIXL moves pages through, grown (and re-registered) to hold `nbytes`."""
        if len(self._staging) < nbytes:
            if self._staging_reg is not None:
                self._agent.deregister_memory(self._staging_reg)
                self._staging_reg = None
            self._staging = np.empty(1 << (nbytes - 1).bit_length(), dtype=np.uint8)
            self._staging_reg = self._agent.register_memory(
                [(self._staging.ctypes.data, len(self._staging), 0, "")], "DRAM")
        return self._staging

    def _transfer(self, op: str, nbytes: int, fd: int) -> None:
        """One NIXL `op` (WRITE: staging -> file, READ: file -> staging) of `nbytes` at offset 0, waited for."""
        file_reg = self._agent.register_memory([(0, nbytes, fd, "")], "FILE")
        try:
            local = self._agent.get_xfer_descs([(self._staging.ctypes.data, nbytes, 0)], "DRAM")
            remote = self._agent.get_xfer_descs([(0, nbytes, fd)], "FILE")
            handle = self._agent.initialize_xfer(op, local, remote, self.agent_name)
            try:
                state = self._agent.transfer(handle)
                while state == "PROC":
                    state = self._agent.check_xfer_state(handle)
                if state != "DONE":
                    raise OSError(f"NIXL {op} of {nbytes} bytes through {FILE_PLUGIN} ended in state {state}")
            finally:
                self._agent.release_xfer_handle(handle)
        finally:
            self._agent.deregister_memory(file_reg)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
