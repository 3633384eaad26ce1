"""RankSupervisor: what rank 0 of a tensor-parallel group and stage 0 of a pipeline share — a keep-alive down an idle
channel, a watchdog over the other processes, the first fatal error kept, and a clean stop."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)
STOP_WAIT_S = 10.0


class RankSupervisor:
    """`kind` names the other processes in messages ("tensor-parallel rank", "pipeline stage"). The subclass sends
    its messages under `_lock` and sets `_last_sent` after each; `_send_keepalive` and `_send_stop` send one
    KEEPALIVE / STOP command on its channel."""

    def __init__(self, kind: str, thread_prefix: str, processes: list[subprocess.Popen], timeout_s: float):
        self.fatal: Optional[str] = None
        self._kind = kind
        self._processes = processes
        self._lock = threading.Lock()
        self._last_sent = time.monotonic()
        self._closed = threading.Event()
        # The other processes wait in a receive bounded by the timeout: an idle rank 0 pings well within it.
        self._keepalive_s = max(timeout_s / 4, 0.5)
        self._threads = [threading.Thread(target=self._keepalive, name=f"{thread_prefix}-keepalive", daemon=True),
                         threading.Thread(target=self._watch, name=f"{thread_prefix}-watchdog", daemon=True)]
        for t in self._threads:
            t.start()

    def _send_keepalive(self) -> None:
        raise NotImplementedError

    def _send_stop(self) -> None:
        raise NotImplementedError

    def _fail(self, message: str) -> None:
        if self.fatal is None:
            logger.error("%s", message)
            self.fatal = message

    def _keepalive(self) -> None:
        while not self._closed.wait(self._keepalive_s / 2):
            if self.fatal is not None:
                return
            if time.monotonic() - self._last_sent < self._keepalive_s or not self._lock.acquire(blocking=False):
                continue
            try:
                self._send_keepalive()
                self._last_sent = time.monotonic()
            except Exception as e:  # noqa: BLE001 - a dead peer: recorded, the engine fails fast
                self._fail(f"{self._kind} keep-alive failed ({type(e).__name__}: {e})")
            finally:
                self._lock.release()

    def _watch(self) -> None:
        while not self._closed.wait(0.2):
            for index, proc in enumerate(self._processes, start=1):
                code = proc.poll()
                if code is not None:
                    self._fail(f"{self._kind} {index} exited with code {code}")
                    return

    def _stop_processes(self, leave_group: Callable[[], None]) -> None:
        """STOP the other processes when they are alive (else kill them), wait for them, then leave the group."""
        with self._lock:
            self._closed.set()
            if self.fatal is None:
                try:
                    self._send_stop()
                except Exception as e:  # noqa: BLE001 - they are killed below
                    logger.warning("could not stop the other %ss cleanly: %s", self._kind, e)
            for proc in self._processes:
                try:
                    proc.wait(timeout=STOP_WAIT_S if self.fatal is None else 0.5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            leave_group()
