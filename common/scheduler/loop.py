"""What every scheduler's event loop is built on: its inbox (requests, aborts, control calls, stop) and the guard
that turns a crashed loop into failed requests instead of callers waiting forever."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional

from tandem.common.cpu_threads import compute_threads
from tandem.common.scheduler.io_struct import GenerateRequest

if TYPE_CHECKING:
    from tandem.common.scheduler.parts import SchedulerProtocol

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # inbox wait when the scheduler has nothing at all to do
POLL_WAIT_S = 0.002  # inbox wait when it only polls transfers: wake soon, but do not spin


class ControlCall:
    """A function to run on the scheduler thread (flush cache, stats), with its result."""

    def __init__(self, fn: Callable[[object], object]):
        self.fn = fn
        self.done = threading.Event()
        self.result: object = None
        self.error: Optional[BaseException] = None

    def run(self, scheduler: object) -> None:
        """A failing call (a profiler that cannot start, say) fails its caller, not the scheduler loop."""
        try:
            self.result = self.fn(scheduler)
        except Exception as e:  # noqa: BLE001 - re-raised on the caller's thread by Engine.call
            self.error = e
        finally:
            self.done.set()


class Inbox:
    """Messages from other threads to the scheduler: GenerateRequest, AbortRequest, ControlCall, STOP."""

    STOP = None  # put() it to end the loop

    def __init__(self):
        self._queue: "queue.Queue" = queue.Queue()
        # When the scheduler last read its inbox (time.monotonic()): every loop iteration reads it once, so its
        # age is how long the step in progress has run. Health reads it without waiting for the step to end.
        self.last_recv = time.monotonic()

    def put(self, msg) -> None:
        self._queue.put(msg)

    def recv(self, wait: float) -> list:
        """Drain the inbox; wait up to `wait` seconds for the first message when there is nothing to do."""
        msgs = []
        try:
            msgs.append(self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait())
            while True:
                msgs.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        self.last_recv = time.monotonic()
        return msgs

    def drain_after_crash(self) -> list[GenerateRequest]:
        """The requests still waiting here (their callers wait too); control calls are released unanswered."""
        pending = []
        for msg in self.recv(0.0):
            if isinstance(msg, ControlCall):
                msg.done.set()
            elif isinstance(msg, GenerateRequest):
                pending.append(msg)
        return pending


def run_scheduler(scheduler: "SchedulerProtocol", threads: int) -> None:
    """The scheduler thread: run its overlap or normal event loop until STOP. If the loop raises, every request
    fails with the error (`fail_everything`) and `scheduler.crash` records it; the model thread stops either way.
    `threads`: the process's torch thread count, which the thread that runs forwards computes with."""
    loop = scheduler.event_loop_overlap if scheduler.runner.overlap else scheduler.event_loop_normal
    # `threads` where this thread computes; where the model thread does, one (a second OpenMP team would slow every
    # op of both: common/cpu_threads.py).
    compute_threads(1 if scheduler.runner.model_thread else threads)
    try:
        loop()
    except Exception as e:
        logger.exception("scheduler loop crashed")
        scheduler.crash = e
        scheduler.fail_everything(f"internal error: scheduler crashed ({type(e).__name__}: {e})")
    finally:
        scheduler.runner.shutdown()
