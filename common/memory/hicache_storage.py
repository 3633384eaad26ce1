"""HiCache's L3: the storage backend interface (put/get pages by key) and the file backend, one file per page."""

from __future__ import annotations

import abc
import logging
import os
import threading
import uuid
from collections import OrderedDict

logger = logging.getLogger(__name__)

PAGE_SUFFIX = ".kvpage"


class StorageBackend(abc.ABC):
    """Pages by hex key. Checksums, the page encoding and the LRU trim to a byte bound live above the backend
    (common/memory/hicache_page.py, hiradix_cache.py), so every backend gets them. Thread-safe: the cache's writer
    and prefetch threads call it beside the scheduler thread."""

    name: str

    @abc.abstractmethod
    def put(self, key: str, payload: bytes) -> None:
        """Store atomically: a reader never sees a half-written page."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The page, or None when absent."""

    @abc.abstractmethod
    def contains(self, key: str) -> bool: ...

    @abc.abstractmethod
    def delete(self, key: str) -> None: ...

    @abc.abstractmethod
    def keys_by_age(self) -> list[str]:
        """Keys, oldest access first (LRU order)."""

    @abc.abstractmethod
    def bytes_used(self) -> int: ...

    @abc.abstractmethod
    def clear(self) -> None: ...


class FileStorage(StorageBackend):
    """`<directory>/<key>.kvpage`, written to a unique temporary name and renamed into place (atomic on POSIX).

    Pages already in the directory are indexed at start (oldest modification first), so a restarted worker, or a
    second worker on the same directory, finds them; `contains` and `get` also look at the disk for pages another
    worker wrote since. Access order is this process's view: a get or put moves the key to the young end.
    """

    name = "file"

    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # key -> bytes, oldest access first
        self._index_existing()

    def _path(self, key: str) -> str:
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"storage key must be lowercase hex, got {key!r}")
        return os.path.join(self.directory, key + PAGE_SUFFIX)

    def _index_existing(self) -> None:
        found = []
        for entry in os.scandir(self.directory):
            if entry.is_file() and entry.name.endswith(PAGE_SUFFIX):
                stat = entry.stat()
                found.append((stat.st_mtime, entry.name[: -len(PAGE_SUFFIX)], stat.st_size))
        for _, key, size in sorted(found):
            self._sizes[key] = size

    def _seen(self, key: str, size: int) -> None:
        with self._lock:
            self._sizes[key] = size
            self._sizes.move_to_end(key)

    def _forget(self, key: str) -> None:
        with self._lock:
            self._sizes.pop(key, None)

    def put(self, key: str, payload: bytes) -> None:
        path = self._path(key)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as f:
            f.write(payload)
        os.replace(tmp, path)
        self._seen(key, len(payload))

    def get(self, key: str) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                payload = f.read()
        except FileNotFoundError:
            self._forget(key)
            return None
        self._seen(key, len(payload))
        return payload

    def contains(self, key: str) -> bool:
        with self._lock:
            if key in self._sizes:
                return True
        try:
            size = os.path.getsize(self._path(key))
        except FileNotFoundError:
            return False
        self._seen(key, size)
        return True

    def delete(self, key: str) -> None:
        self._forget(key)
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass

    def keys_by_age(self) -> list[str]:
        with self._lock:
            return list(self._sizes)

    def bytes_used(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def clear(self) -> None:
        for key in self.keys_by_age():
            self.delete(key)


def make_storage_backend(kind: str, directory: str, max_bytes: int) -> StorageBackend:
    """The L3 backend `kind` over `directory` (`max_bytes` is enforced above the backend, by the cache's trim)."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    if kind == "file":
        return FileStorage(directory)
    if kind == "nixl":
        from tandem.common.memory.hicache_nixl import NixlFileStorage  # optional: needs NIXL's file plugin

        return NixlFileStorage(directory)
    raise ValueError(f"unknown HiCache storage backend {kind!r} (file or nixl)")
