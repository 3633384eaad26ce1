"""StepProfiler: per-step time split into schedule / prepare / forward / sample / output, for
`tandem bench offline --profile-steps`; attached to a running scheduler, so it costs nothing when not attached."""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from typing import Callable

import torch

PHASES = ("schedule", "prepare", "forward", "sample", "output")


class StepProfiler:
    """Wraps, on one scheduler's instances, the five calls a step makes, and sums their wall time per batch mode
    (extend, decode). Phases on different threads (the overlap loop's forward and sample run on the model thread)
    overlap in time, so their sum may exceed a step's wall time."""

    def __init__(self):
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(PHASES, 0.0))
        self.steps: dict[str, int] = defaultdict(int)
        self._sync: Callable[[], None] = lambda: None

    def attach(self, scheduler) -> None:
        """Time this scheduler's steps from now on; call it on the scheduler thread (Engine.call)."""
        worker = scheduler.runner.worker
        if worker.device.type == "cuda":
            self._sync = functools.partial(torch.cuda.synchronize, worker.device)
        batcher, outputs = scheduler.batcher, scheduler.outputs
        batcher.get_next_batch_to_run = self._timed("schedule", batcher.get_next_batch_to_run,
                                                    mode_of=lambda args, out: out.mode if out is not None else None)
        worker.prepare = self._timed("prepare", worker.prepare, mode_of=_work_mode)
        worker.forward = self._timed("forward", worker.forward, mode_of=_work_mode, sync=True)
        worker.sample = self._timed("sample", worker.sample, mode_of=_work_mode, count=True)
        outputs.process_batch_result = self._timed("output", outputs.process_batch_result,
                                                   mode_of=lambda args, out: args[0].mode)

    def _timed(self, phase: str, fn: Callable, mode_of: Callable, sync: bool = False, count: bool = False):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if sync:
                self._sync()
            mode = mode_of(args, out)
            if mode is not None:  # an idle poll of the scheduler is no step
                self.seconds[mode.value][phase] += time.perf_counter() - start
                self.steps[mode.value] += count
            return out
        return timed

    def report(self) -> dict:
        """Per batch mode: steps, mean milliseconds per step of each phase, their sum, and forward's share."""
        out = {}
        for mode, seconds in sorted(self.seconds.items()):
            steps = self.steps[mode]
            if not steps:
                continue
            row = {"steps": steps, **{f"{p}_ms": seconds[p] * 1000 / steps for p in PHASES}}
            row["total_ms"] = sum(row[f"{p}_ms"] for p in PHASES)
            row["forward_share"] = row["forward_ms"] / row["total_ms"] if row["total_ms"] else 0.0
            out[mode] = row
        return out


def _work_mode(args, out):
    return args[0].forward_batch.mode


def format_report(report: dict) -> str:
    """The report as a table: one row per batch mode, milliseconds per step."""
    lines = [f"{'mode':<8} {'steps':>6} " + " ".join(f"{p:>9}" for p in PHASES) + f" {'sum ms':>8} {'fwd %':>6}"]
    for mode, row in report.items():
        lines.append(f"{mode:<8} {row['steps']:>6} " + " ".join(f"{row[p + '_ms']:>9.2f}" for p in PHASES)
                     + f" {row['total_ms']:>8.2f} {100 * row['forward_share']:>6.1f}")
    return "\n".join(lines)
