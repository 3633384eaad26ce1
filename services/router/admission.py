"""Admission: a request runs when a KV-holding worker (decode, or unified) has room for its whole generation and
fewer than --max-running-requests run; otherwise it waits in a bounded FIFO queue, 429 with Retry-After when
the queue is full or the wait passes --queue-timeout-s.

The reservation is the prompt plus max_tokens for each sequence: what the request can come to hold at most. With
it an admitted request is never retracted or left waiting at the decode for pages (where a prefill's bootstrap
timeout would turn it into a 504); the price is idle KV when outputs end early, which the prefix cache fills.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional

from tandem.services.router.errors import ApiError
from tandem.services.router.messages import TokenRequest
from tandem.services.router.workers import DpRank, Placement, Worker, WorkerRegistry

HOLD_EWMA = 0.2  # weight of the latest request in the mean time a request holds its reservation
MAX_RETRY_AFTER_S = 60


def kv_tokens(req: TokenRequest) -> int:
    """The KV tokens a request may come to hold: each sequence's prompt plus its whole output."""
    return req.sampling.n * (len(req.input_ids) + req.max_new_tokens)


@dataclass(eq=False)
class KvTicket:
    """An admitted request's reservation until dispatch places it on workers (then each leg holds its own)."""

    unplaced: int  # tokens admitted but not yet placed on a worker
    outer: Optional["KvTicket"] = None  # the ticket of an earlier prompt of the same batched request
    admitted_at: float = field(default_factory=time.monotonic)


# The ticket of the request this task serves: set by Admission.admit around the request's stream, read by the
# dispatcher when it places the request's legs (its n > 1 fan-out tasks inherit it).
CURRENT_TICKET: ContextVar[Optional[KvTicket]] = ContextVar("tandem_kv_ticket", default=None)


@dataclass(eq=False)
class _Waiter:
    tokens: int
    future: asyncio.Future


class Admission:
    def __init__(self, registry: WorkerRegistry, max_running: int, max_queued: int, queue_timeout_s: float,
                 by_kv: bool = True):
        self.registry = registry
        self.by_kv = by_kv  # False (--no-kv-admission): only the running limit
        self.max_running = max_running
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.running = 0
        self.unplaced = 0  # tokens of admitted requests not yet placed on a worker
        self.queue: deque[_Waiter] = deque()
        self.hold_s: Optional[float] = None  # mean time an admitted request held its reservation
        self.on_reject: Callable[[str], None] = lambda reason: None  # the metrics' counter
        registry.listeners.append(self.wake)

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def fits(self, tokens: int) -> bool:
        """Some KV-holding worker has room for `tokens` besides what is admitted and not placed yet (counted
        against every worker: it is placed within a moment, and only dispatch knows where)."""
        if not self.by_kv:
            return True
        holders = self.registry.kv_holders()
        return not holders or any(w.kv.fits(tokens, self.unplaced) for w in holders)

    def _can_run(self, tokens: int) -> bool:
        return self.running < self.max_running and self.fits(tokens)

    def wake(self) -> None:
        """Admit queued requests, oldest first, while the oldest fits (FIFO: a large request is not starved)."""
        while self.queue:
            head = self.queue[0]
            if head.future.done():  # timed out or cancelled
                self.queue.popleft()
                continue
            if not self._can_run(head.tokens):
                return
            self.queue.popleft()
            self._start(head.tokens)
            head.future.set_result(None)

    def _start(self, tokens: int) -> None:
        self.running += 1
        self.unplaced += tokens

    def retry_after_s(self) -> int:
        """Seconds a refused client should wait: about how long admitted requests hold their reservation."""
        return min(MAX_RETRY_AFTER_S, max(1, math.ceil(self.hold_s or 1)))

    def _refuse(self, code: str, message: str) -> ApiError:
        self.on_reject(code)
        retry = self.retry_after_s()
        return ApiError(429, f"{message}; retry after {retry}s", code=code, headers={"Retry-After": str(retry)})

    async def _wait(self, tokens: int) -> None:
        if not self.queue and self._can_run(tokens):
            self._start(tokens)
            return
        if len(self.queue) >= self.max_queued:
            raise self._refuse("queue_full", f"the router's queue is full ({len(self.queue)} requests waiting for "
                                             f"KV capacity or a running slot, {self.running} running)")
        waiter = _Waiter(tokens, asyncio.get_running_loop().create_future())
        self.queue.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), self.queue_timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            admitted = waiter.future.done() and not waiter.future.cancelled()  # in the same tick as the timeout
            waiter.future.cancel()
            if isinstance(e, asyncio.TimeoutError):
                if admitted:
                    return
                raise self._refuse("queue_timeout", f"no worker had KV capacity for this request ({tokens} "
                                                    f"tokens) within --queue-timeout-s ({self.queue_timeout_s:g}s)"
                                   ) from None
            if admitted:  # the client left just as it was admitted
                self.running -= 1
                self.unplaced -= tokens
                self.wake()
            raise
        finally:
            if waiter in self.queue:
                self.queue.remove(waiter)

    @asynccontextmanager
    async def admit(self, req: TokenRequest) -> AsyncIterator[KvTicket]:
        """Hold a running slot and the request's KV reservation for the block; the dispatcher moves the
        reservation onto the workers it picks (place/release)."""
        tokens = kv_tokens(req)
        outer = CURRENT_TICKET.get()
        if outer is None:
            await self._wait(tokens)
        else:
            # A later prompt of a batched request (a completions prompt list): admitted with the first, which
            # waited; all of a batch's prompts start together, so waiting here could only time out.
            self._start(tokens)
        ticket = KvTicket(tokens, outer)
        reset = CURRENT_TICKET.set(ticket)
        try:
            yield ticket
        finally:
            CURRENT_TICKET.reset(reset)
            self._finish(ticket)

    def _finish(self, ticket: KvTicket) -> None:
        self.running -= 1
        self.unplaced -= ticket.unplaced
        ticket.unplaced = 0
        held = time.monotonic() - ticket.admitted_at
        self.hold_s = held if self.hold_s is None else (1 - HOLD_EWMA) * self.hold_s + HOLD_EWMA * held
        self.wake()

    # ---- the dispatcher's side ---------------------------------------------------------------------

    def place(self, worker: Worker, tokens: int, rank: Optional[DpRank] = None) -> Placement:
        """Reserve `tokens` on `worker` (and on its DP `rank` when the leg is pinned there) for one leg, taking them
        from the current request's ticket."""
        ticket, needed = CURRENT_TICKET.get(), tokens
        while ticket is not None and needed > 0:  # a batch's prompts share one context: take from each in turn
            taken = min(ticket.unplaced, needed)
            ticket.unplaced -= taken
            self.unplaced -= taken
            needed -= taken
            ticket = ticket.outer
        placement = Placement(tokens)
        worker.kv.placements.add(placement)
        if rank is not None:
            rank.kv.placements.add(placement)
        return placement

    def release(self, worker: Worker, placement: Placement, rank: Optional[DpRank] = None) -> None:
        worker.kv.placements.discard(placement)
        if rank is not None:
            rank.kv.placements.discard(placement)
        self.wake()
