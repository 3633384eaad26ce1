"""HiCache's L3 storage interface (stand-in: the engine branch's hicache_storage.py replaces this file at merge)."""

from __future__ import annotations

import abc


class StorageBackend(abc.ABC):
    """Pages keyed by hex content hashes. Checksums, page encoding and LRU trimming live above the backend."""

    name: str  # "file" | "nixl"

    @abc.abstractmethod
    def put(self, key: str, payload: bytes) -> None:
        """Store `payload` atomically: a reader never sees a half-written page."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The page's bytes, or None when absent."""

    @abc.abstractmethod
    def contains(self, key: str) -> bool: ...

    @abc.abstractmethod
    def delete(self, key: str) -> None: ...

    @abc.abstractmethod
    def keys_by_age(self) -> list[str]:
        """Oldest access first (LRU order), for eviction."""

    @abc.abstractmethod
    def bytes_used(self) -> int: ...

    @abc.abstractmethod
    def clear(self) -> None: ...
