"""Back-pressure: at most --max-running-requests at the workers, a bounded queue behind them, 429 beyond."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator

from services.router.errors import ApiError


class Admission:
    def __init__(self, max_running: int, max_queued: int):
        self.max_running = max_running
        self.max_queued = max_queued
        self.running = 0
        self.waiting = 0
        self._slots = asyncio.Semaphore(max_running)

    @asynccontextmanager
    async def slot(self, timeout_s: float) -> AsyncIterator[None]:
        if self.running >= self.max_running or self.waiting:
            if self.waiting >= self.max_queued:
                raise ApiError(429, f"the router's queue is full ({self.waiting} requests waiting, "
                                    f"{self.running} running); retry later", code="queue_full")
        self.waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(503, f"timed out after {timeout_s:g}s waiting in the router's queue",
                           code="queue_timeout") from None
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()
