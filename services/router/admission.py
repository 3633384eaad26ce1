"""Admission: a request runs when a KV-holding worker (decode, or unified) has room for what it is expected to
hold and fewer than --max-running-requests run; otherwise it waits in a bounded FIFO queue, 429 with Retry-After
when the queue is full or the wait passes --queue-timeout-s.

--admission-reserve full reserves each sequence's prompt plus max_tokens: what it can come to hold at most, never
more than the pool, so an admitted request never waits at the decode for pages; but a burst of chat requests
without max_tokens (which then means the rest of the context) is refused long before the pool is used.

--admission-reserve estimate (the default) reserves the prompt plus `ratio` x max_tokens, SGLang's new-token ratio
learned here from the requests that finish: one that used less than its estimate lowers the ratio a step, one
that used more raises it four steps (so it settles near the 80th percentile of the fraction of max_tokens used),
and a decode reporting legs that wait for pages raises it too. When the estimate was short the workers cope:
a decode leg waits in the prealloc queue (its heartbeats keep the prefill's bootstrap timeout from firing) and a
running request is retracted and recomputed locally (common/scheduler/batcher.py). The workers' reported usage
bounds admission as well (KvCapacity.committed), so an estimate that runs low is corrected by what the pools hold.
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
RATIO_STEP = 0.04  # an early finish lowers the new-token ratio this much; a long one raises it RATIO_RISE times that
RATIO_RISE = 4


def kv_tokens(req: TokenRequest) -> int:
    """The KV tokens a request may come to hold: each sequence's prompt plus its whole output."""
    return req.sampling.n * (len(req.input_ids) + req.max_new_tokens)


def output_tokens(req: TokenRequest) -> int:
    return req.sampling.n * req.max_new_tokens


class NewTokenRatio:
    """The fraction of max_tokens a request is expected to use: starts at 1 (nothing learned yet), moves by
    finished requests' real use and by the decodes' page pressure, never below `floor`."""

    def __init__(self, floor: float):
        self.floor = floor
        self.value = 1.0

    def observe(self, used_fraction: float) -> None:
        if used_fraction < self.value:
            self.value = max(self.floor, self.value - RATIO_STEP)
        elif used_fraction > self.value:
            self.raise_for_pressure()

    def raise_for_pressure(self) -> None:
        self.value = min(1.0, self.value + RATIO_RISE * RATIO_STEP)

    def reserve(self, req: TokenRequest) -> int:
        """KV tokens to reserve for `req`: each sequence's prompt plus its expected share of max_tokens."""
        return req.sampling.n * (len(req.input_ids) + math.ceil(self.value * req.max_new_tokens))


@dataclass(eq=False)
class KvTicket:
    """An admitted request's reservation until dispatch places it on workers (then each leg holds its own)."""

    unplaced: int  # tokens admitted but not yet placed on a worker
    outer: Optional["KvTicket"] = None  # the ticket of an earlier prompt of the same batched request
    admitted_at: float = field(default_factory=time.monotonic)
    reserved: int = 0  # tokens admitted for the request (the estimate, or kv_tokens under `full`)
    full: int = 0  # kv_tokens of the request: a leg reserves the share of its tokens that `unplaced` is of this
    max_output: int = 0  # n x max_new_tokens
    generated: Optional[int] = None  # output tokens, set by the caller once the request completed

    @property
    def share(self) -> float:
        """The fraction of a leg's full KV tokens this request's legs reserve."""
        return 1.0 if self.full <= 0 else min(1.0, self.reserved / self.full)


# The ticket of the request this task serves: set by Admission.admit around the request's stream, read by the
# dispatcher when it places the request's legs (its n > 1 fan-out tasks inherit it).
CURRENT_TICKET: ContextVar[Optional[KvTicket]] = ContextVar("tandem_kv_ticket", default=None)


@dataclass(eq=False)
class _Waiter:
    req: TokenRequest  # its reservation is estimated when it is admitted, with what was learned meanwhile
    future: asyncio.Future


class Admission:
    def __init__(self, registry: WorkerRegistry, max_running: int, max_queued: int, queue_timeout_s: float,
                 by_kv: bool = True, reserve: str = "estimate", min_ratio: float = 0.1):
        self.registry = registry
        self.by_kv = by_kv  # False (--no-kv-admission): only the running limit
        self.ratio = NewTokenRatio(min_ratio) if reserve == "estimate" else None  # None: reserve max_tokens
        self.max_running = max_running
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.running = 0
        self.unplaced = 0  # tokens of admitted requests not yet placed on a worker
        self.queue: deque[_Waiter] = deque()
        self.hold_s: Optional[float] = None  # mean time an admitted request held its reservation
        self.on_reject: Callable[[str], None] = lambda reason: None  # the metrics' counter
        registry.listeners.append(self.on_capacity)

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

    def reservation(self, req: TokenRequest) -> int:
        return kv_tokens(req) if self.ratio is None else self.ratio.reserve(req)

    def on_capacity(self) -> None:
        """A worker reported (or turned healthy): a decode with legs waiting for pages says the estimate ran
        short; then admit what fits."""
        if self.ratio is not None and any(w.role == "decode" and w.load.waiting > 0
                                          for w in self.registry.kv_holders()):
            self.ratio.raise_for_pressure()
        self.wake()

    def wake(self) -> None:
        """Admit queued requests, oldest first, while the oldest fits (FIFO: a large request is not starved)."""
        while self.queue:
            head = self.queue[0]
            if head.future.done():  # timed out or cancelled
                self.queue.popleft()
                continue
            tokens = self.reservation(head.req)
            if not self._can_run(tokens):
                return
            self.queue.popleft()
            self._start(tokens)
            head.future.set_result(tokens)

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

    async def _wait(self, req: TokenRequest) -> int:
        """Wait for admission; the tokens reserved."""
        tokens = self.reservation(req)
        if not self.queue and self._can_run(tokens):
            self._start(tokens)
            return tokens
        if len(self.queue) >= self.max_queued:
            raise self._refuse("queue_full", f"the router's queue is full ({len(self.queue)} requests waiting for "
                                             f"KV capacity or a running slot, {self.running} running)")
        waiter = _Waiter(req, asyncio.get_running_loop().create_future())
        self.queue.append(waiter)
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), self.queue_timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            admitted = waiter.future.done() and not waiter.future.cancelled()  # in the same tick as the timeout
            waiter.future.cancel()
            if isinstance(e, asyncio.TimeoutError):
                if admitted:
                    return waiter.future.result()
                raise self._refuse("queue_timeout", f"no worker had KV capacity for this request ({self.reservation(req)} "
                                                    f"tokens) within --queue-timeout-s ({self.queue_timeout_s:g}s)"
                                   ) from None
            if admitted:  # the client left just as it was admitted
                self.running -= 1
                self.unplaced -= waiter.future.result()
                self.wake()
            raise
        finally:
            if waiter in self.queue:
                self.queue.remove(waiter)

    @asynccontextmanager
    async def admit(self, req: TokenRequest) -> AsyncIterator[KvTicket]:
        """Hold a running slot and the request's KV reservation for the block; the dispatcher moves the
        reservation onto the workers it picks (place/release)."""
        outer = CURRENT_TICKET.get()
        if outer is None:
            tokens = await self._wait(req)
        else:
            # A later prompt of a batched request (a completions prompt list): admitted with the first, which
            # waited; all of a batch's prompts start together, so waiting here could only time out.
            tokens = self.reservation(req)
            self._start(tokens)
        ticket = KvTicket(tokens, outer, reserved=tokens, full=kv_tokens(req), max_output=output_tokens(req))
        reset = CURRENT_TICKET.set(ticket)
        try:
            yield ticket
        finally:
            self._finish(ticket)
            try:
                CURRENT_TICKET.reset(reset)
            except ValueError:
                # Closed from another context: a stream the client abandoned (a gRPC deadline) has its generators
                # finalized by the event loop, outside the request's task. That context never held the ticket;
                # the slot and reservation are given back above all the same.
                pass

    def _finish(self, ticket: KvTicket) -> None:
        self.running -= 1
        self.unplaced -= ticket.unplaced
        ticket.unplaced = 0
        held = time.monotonic() - ticket.admitted_at
        self.hold_s = held if self.hold_s is None else (1 - HOLD_EWMA) * self.hold_s + HOLD_EWMA * held
        if self.ratio is not None and ticket.generated is not None and ticket.max_output > 0:
            self.ratio.observe(ticket.generated / ticket.max_output)
        self.wake()

    # ---- the dispatcher's side ---------------------------------------------------------------------

    def place(self, worker: Worker, tokens: int, rank: Optional[DpRank] = None) -> Placement:
        """Reserve one leg's share of its `tokens` (kv_tokens: prompt plus max_tokens) on `worker` (and on its DP
        `rank` when the leg is pinned there), taking it from the current request's ticket: the whole under
        --admission-reserve full, the estimate's share of it under estimate."""
        ticket = CURRENT_TICKET.get()
        if ticket is not None:
            tokens = math.ceil(tokens * ticket.share)
        needed = tokens
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
