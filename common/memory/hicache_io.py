"""StorageIO: HiCache's traffic with L3 — a background writer (bounded queue), prefetch reads under a policy, the
LRU trim to --hicache-storage-max-bytes, and the disk-tier KV events."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue
import threading
from typing import Optional

import torch

from tandem.common.cpu_threads import compute_threads
from tandem.common.memory.cache_events import BlockRemoved, BlockStored
from tandem.common.memory.hicache_page import PageLayout, encode_page, storage_key
from tandem.common.memory.hicache_storage import StorageBackend
from tandem.common.telemetry.metrics import HiCacheMetrics

logger = logging.getLogger(__name__)

WRITE_QUEUE_PAGES = 1024  # writes waiting for the writer thread; beyond, a write is skipped (counted)
READ_THREADS = 2
MAX_PENDING_READS = 256  # pages read ahead for requests not scheduled yet; the oldest go beyond


class StorageIO:
    """Owned by the scheduler thread (every public method runs there); the writer and read threads touch only the
    backend, the counters they own, and the event deque.

    Prefetch policies (`read_prefix`): best_effort returns the pages whose reads have finished (a request's reads
    start at its first match; a request matched again later finds more), wait_complete waits for all, timeout for
    at most `timeout_s`.
    """

    def __init__(self, backend: StorageBackend, max_bytes: int, identity: bytes, policy: str, timeout_s: float,
                 metrics: Optional[HiCacheMetrics] = None, emit_events: bool = False):
        self.backend = backend
        self.max_bytes = max_bytes
        self.identity = identity
        self.policy = policy
        self.timeout_s = timeout_s
        self.metrics = metrics or HiCacheMetrics(None)
        self.emit_events = emit_events
        self.skipped_writes = 0
        self.written_pages = 0
        self._events: collections.deque = collections.deque()
        self._hash_of_key: dict[str, int] = {}  # pages this process stored: their block hash, for removal events
        self._queued: set[str] = set()  # keys waiting in the write queue
        self._queue: queue.Queue = queue.Queue(WRITE_QUEUE_PAGES)
        self._reads: collections.OrderedDict[str, concurrent.futures.Future] = collections.OrderedDict()
        # Storage threads copy and hash pages on one thread each: no OpenMP team beside the model's
        # (common/cpu_threads.py).
        self._readers = concurrent.futures.ThreadPoolExecutor(READ_THREADS, thread_name_prefix="hicache-read",
                                                              initializer=compute_threads, initargs=(1,))
        self._writer = threading.Thread(target=self._write_forever, name="hicache-write", daemon=True)
        self._writer.start()
        self.metrics.storage_bytes.set(backend.bytes_used())

    def key(self, page_hash: int) -> str:
        return storage_key(self.identity, page_hash)

    # ----- writes ------------------------------------------------------------------------------

    def write_pages(self, layout: PageLayout, hashes: list[int], parent_hash: Optional[int], tokens: list[int],
                    rows: list[torch.Tensor]) -> None:
        """Queue the pages of one node (`rows`: K then V per layer over all its tokens, raw bytes, copies the caller
        does not touch again); the writer thread encodes and stores them."""
        size = layout.page_size
        for i, page_hash in enumerate(hashes):
            key = self.key(page_hash)
            if key in self._hash_of_key and self.backend.contains(key):
                continue
            page_rows = [r[i * size:(i + 1) * size] for r in rows]  # views of fresh copies: safe to encode later
            stored = BlockStored([page_hash], parent_hash if i == 0 else hashes[i - 1],
                                 tokens[i * size:(i + 1) * size], size, "", "disk")
            self._queued.add(key)  # before the writer can take it
            try:
                self._queue.put_nowait((key, layout, page_rows, stored))
            except queue.Full:
                self._queued.discard(key)
                self.skipped_writes += 1

    def _write_forever(self) -> None:
        compute_threads(1)
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write_one(*item)
            except Exception:  # noqa: BLE001 - a failed write loses a page of cache, never the worker
                logger.exception("HiCache: L3 write failed")
            finally:
                if item is not None:
                    self._queued.discard(item[0])
                self._queue.task_done()

    def _write_one(self, key: str, layout: PageLayout, rows: list[torch.Tensor], stored: BlockStored) -> None:
        """On the writer thread: encode (header, checksum) and store the page unless storage has it."""
        if not self.backend.contains(key):
            page = encode_page(layout, rows)
            self.backend.put(key, page)
            self.written_pages += 1
            self.metrics.moved_bytes("disk", "write", len(page))
            if self.emit_events:
                self._events.append(stored)
        self._hash_of_key[key] = stored.block_hashes[0]
        self._trim()

    def _trim(self) -> None:
        """Delete the least recently used pages until L3 fits max_bytes."""
        used = self.backend.bytes_used()
        if used > self.max_bytes:
            for key in self.backend.keys_by_age():
                self.backend.delete(key)
                self._removed(key)
                used = self.backend.bytes_used()
                if used <= self.max_bytes:
                    break
        self.metrics.storage_bytes.set(used)

    def _removed(self, key: str) -> None:
        page_hash = self._hash_of_key.pop(key, None)
        if page_hash is not None and self.emit_events:
            self._events.append(BlockRemoved([page_hash], "disk"))

    def flush(self) -> None:
        """Wait until every queued write is on storage (tests; a clean shutdown)."""
        self._queue.join()

    # ----- reads -------------------------------------------------------------------------------

    def start_reads(self, hashes: list[int]) -> list[tuple[str, concurrent.futures.Future]]:
        """Submit reads for the first pages of `hashes` that storage holds, consecutive from the first; return
        their keys and reads (reads already running are kept)."""
        reads = []
        for page_hash in hashes:
            key = self.key(page_hash)
            if key not in self._reads and not self.backend.contains(key):
                if not (self.policy == "wait_complete" and key in self._queued):
                    break
                self.flush()  # the page is on its way to storage: wait_complete waits for it too
                if not self.backend.contains(key):
                    break
            if key in self._reads:
                self._reads.move_to_end(key)
            else:
                self._reads[key] = self._readers.submit(self.backend.get, key)
            reads.append((key, self._reads[key]))
        self._forget_old_reads()
        return reads

    def read_prefix(self, hashes: list[int]) -> list[bytes]:
        """Payloads of the first pages of `hashes` that storage holds, consecutive from the first, as far as the
        prefetch policy lets this call wait."""
        reads = self.start_reads(hashes)
        futures = [future for _, future in reads]
        if self.policy == "wait_complete":
            concurrent.futures.wait(futures)
        elif self.policy == "timeout":
            concurrent.futures.wait(futures, timeout=self.timeout_s)
        payloads = []
        for key, future in reads:
            if not future.done():
                break
            self._reads.pop(key, None)
            payload = future.exception() is None and future.result()
            if not payload:
                break
            payloads.append(payload)
        return payloads

    def _forget_old_reads(self) -> None:
        while len(self._reads) > MAX_PENDING_READS:
            key = next(iter(self._reads))
            self._reads.pop(key).cancel()

    def drop(self, page_hash: int) -> None:
        """A page that failed its checks: delete it so nobody reads it again."""
        key = self.key(page_hash)
        self.backend.delete(key)
        self._removed(key)

    def clear(self) -> None:
        self.flush()
        for key in self.backend.keys_by_age():
            self._removed(key)
        self.backend.clear()
        self._reads.clear()
        self.metrics.storage_bytes.set(self.backend.bytes_used())

    def set_identity(self, identity: bytes) -> None:
        """New weights (a new weight version): pages stored under the old identity are never matched again."""
        self.flush()
        self.identity = identity
        self._reads.clear()

    def take_events(self) -> list:
        events = []
        while self._events:
            events.append(self._events.popleft())
        return events

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(timeout=30)
        self._readers.shutdown(wait=False, cancel_futures=True)
