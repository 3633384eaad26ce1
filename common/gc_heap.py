"""Freezing a serving process's start-up heap, so that garbage collection never walks it again."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now (torch, the model, the pools: ~200k objects) into the
    permanent generation; returns how many were frozen.

    Call it once a process has loaded and is about to serve. Full collections during serving then skip those
    objects (shorter pauses of the scheduler thread), and so does the interpreter's last collection at exit:
    a worker's exit after SIGTERM drops from ~0.8 s to ~0.2 s. vLLM freezes its engine's heap after
    start-up for the same reason. The collection first keeps start-up garbage out of the frozen set, where it
    would never be freed."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
