"""KvEventHub: drains the RadixCache's KV events, numbers them into KvEventBatches and fans them out."""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from typing import AsyncIterator, Optional

from smg_grpc_proto.generated import common_pb2

from tandem.common.memory.cache_events import AllCleared, BlockRemoved, BlockStored
from tandem.common.rpc.loads import LoadSampler, LoadSnapshot, engine_load, read_scheduler

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.05  # while someone subscribes
IDLE_POLL_INTERVAL_S = 1.0  # nobody subscribes: drain only, so the cache's event list stays small
HEARTBEAT_S = 1.0
HISTORY_BATCHES = 4096  # replay window for start_sequence_number


def _take_events_and_load(s) -> tuple[list, dict]:
    tree = s.ops.tree_cache
    events = tree.take_events() if hasattr(tree, "take_events") else []
    return events, read_scheduler(s)


TIER_TO_PROTO = {"device": common_pb2.KV_CACHE_TIER_DEVICE, "host": common_pb2.KV_CACHE_TIER_HOST,
                 "disk": common_pb2.KV_CACHE_TIER_DISK}


def event_to_proto(event, event_id: int) -> common_pb2.KvCacheEvent:
    msg = common_pb2.KvCacheEvent(event_id=event_id)
    if isinstance(event, BlockStored):
        size = event.block_size
        stored = msg.stored
        stored.tier = TIER_TO_PROTO[event.tier]
        stored.locality = common_pb2.KV_CACHE_LOCALITY_LOCAL
        if event.parent_block_hash is not None:
            stored.parent_block_hash = event.parent_block_hash
        if event.lora_id:  # the hashes already fold it in (page_hash.namespace_seed); named for other consumers
            stored.lora_name = event.lora_id
        for i, block in enumerate(event.block_hashes):
            stored.blocks.add(block_hash=block, token_ids=event.token_ids[i * size:(i + 1) * size], block_size=size)
    elif isinstance(event, BlockRemoved):
        msg.removed.block_hashes.extend(event.block_hashes)
        msg.removed.tier = TIER_TO_PROTO[event.tier]
    elif isinstance(event, AllCleared):
        msg.cleared.SetInParent()
    else:
        raise TypeError(f"unknown KV event {event!r}")
    return msg


class KvEventHub:
    """One poller per worker (take_events drains, so subscribers must share it), many subscriber queues."""

    def __init__(self, engine, sampler: LoadSampler, role: str):
        self.engine = engine
        self.sampler = sampler
        self.role = role
        self.sequence = 0
        self._event_ids = itertools.count(1)
        self._history: collections.deque = collections.deque(maxlen=HISTORY_BATCHES)
        self._subscribers: set[asyncio.Queue] = set()
        self._task: Optional[asyncio.Task] = None
        self.last_load: Optional[LoadSnapshot] = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._poll_forever(), name="kv-event-poller")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(POLL_INTERVAL_S if self._subscribers else IDLE_POLL_INTERVAL_S)
            try:
                events, raw = await asyncio.to_thread(self.engine.call, _take_events_and_load)
            except Exception:  # the engine is shutting down; keep serving what we have
                logger.debug("KV event poll failed", exc_info=True)
                continue
            self.last_load = self.sampler.from_raw(raw)
            if events:
                self.sequence += 1
                protos = [event_to_proto(e, next(self._event_ids)) for e in events]
                batch = (self.sequence, time.time(), protos)
                self._history.append(batch)
                for queue in self._subscribers:
                    queue.put_nowait(batch)
            elif self._subscribers:
                for queue in self._subscribers:
                    queue.put_nowait(None)  # a load tick: the subscriber decides whether to send it

    async def subscribe(self, request: common_pb2.SubscribeKvEventsRequest) -> AsyncIterator[common_pb2.KvEventBatch]:
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers.add(queue)
        samples = itertools.count(1)
        last_seq, last_sent_at, last_key = 0, 0.0, None
        try:
            if self.last_load is None:
                self.last_load = await asyncio.to_thread(self.sampler.sample)
            if request.start_sequence_number > 0:
                for batch in [b for b in self._history if b[0] >= request.start_sequence_number]:
                    last_seq = batch[0]
                    yield self._batch(batch, next(samples), full=last_sent_at == 0.0)
                    last_sent_at = time.monotonic()
            if last_seq == 0 and request.load_records_before_first_batch:
                yield self._load_only(0, next(samples))
                last_sent_at = time.monotonic()
            while True:
                batch = await queue.get()
                if batch is not None:
                    if batch[0] <= last_seq:
                        continue  # already replayed from history
                    last_seq = batch[0]
                    yield self._batch(batch, next(samples), full=False)
                    last_sent_at = time.monotonic()
                    continue
                if last_seq == 0 and not request.load_records_before_first_batch:
                    continue  # an old subscriber would take a batch numbered 0 for a duplicate
                snap = self.last_load
                key = None if snap is None else (snap.running, snap.waiting, round(snap.token_usage, 4))
                if key != last_key or time.monotonic() - last_sent_at >= HEARTBEAT_S:
                    last_key = key
                    yield self._load_only(last_seq, next(samples))
                    last_sent_at = time.monotonic()
        finally:
            self._subscribers.discard(queue)

    def _batch(self, batch: tuple, sample: int, full: bool) -> common_pb2.KvEventBatch:
        seq, stamp, protos = batch
        msg = common_pb2.KvEventBatch(sequence_number=seq, timestamp=stamp, events=protos, dp_rank=0)
        if self.last_load is not None:
            msg.load.CopyFrom(engine_load(self.last_load, self.role, sample, load_only=False, full=full))
        return msg

    def _load_only(self, seq: int, sample: int) -> common_pb2.KvEventBatch:
        return common_pb2.KvEventBatch(sequence_number=seq, timestamp=time.time(), dp_rank=0,
                                       load=engine_load(self.last_load, self.role, sample, load_only=True, full=True))
