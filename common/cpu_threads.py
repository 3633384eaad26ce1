"""Which threads of a process start OpenMP teams: one long-lived thread computes, so small ops stay cheap.

torch's CPU ops run on OpenMP (libgomp) teams: each thread that starts a parallel region gets a team of its own,
alive as long as that thread. Once the process holds more team threads than CPUs, libgomp stops spinning between
regions (its "throttled" spin count) and every parallel op pays a futex wake-up: on a 2-core VM a 64 x 512 mean
took ~100 us on a second team's thread against ~8 us with one team (`tandem bench` history, issue 31), and a
decode step of the small model has ~150 such ops. An engine therefore loads its model on a short-lived thread (the
team ends with it) and leaves compute to one thread: the scheduler thread in the normal loop, the model thread in
the overlap loop, where the scheduler thread runs its own ops on one thread (no team), as storage threads do.
"""

from __future__ import annotations

import threading
from typing import Any, Callable


def run_on_fresh_thread(fn: Callable[..., Any], *args: Any, name: str = "tandem-load") -> Any:
    """fn(*args) on a new thread with the calling thread's thread count, joined: its OpenMP team ends with it, so
    the calling thread (which may live for the whole process) never holds one. Returns fn's result; re-raises its
    exception here."""
    import torch

    threads = torch.get_num_threads()
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            compute_threads(threads)
            outcome["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001  (re-raised on the calling thread)
            outcome["error"] = e

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


def compute_threads(n: int) -> None:
    """This thread's torch CPU ops use `n` threads from now on (1: no OpenMP team of its own). torch keeps the count
    per thread once a thread has used it, and hands the latest count set anywhere to threads that have not yet, so
    every thread of an engine that runs torch ops sets its own: the computing thread the process's count, the
    others 1."""
    import torch

    torch.set_num_threads(n)
