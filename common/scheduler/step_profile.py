"""StepProfiler: per-step time split into schedule / prepare / forward / sample / output, and each mode's step
period and rows per step, for `tandem bench offline --profile-steps` and a worker's `--profile-steps`; attached to
a scheduler, so it costs nothing when not attached."""

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
    overlap in time, so their sum may exceed a step's wall time. The step period (`step_ms`) is the wall time
    between two consecutive batches of the same mode being scheduled: what a step really costs, Python around
    the forward and other threads' GIL time included."""

    def __init__(self):
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(PHASES, 0.0))
        self.steps: dict[str, int] = defaultdict(int)
        self.rows: dict[str, int] = defaultdict(int)  # requests per batch, summed over the batches scheduled
        self.scheduled: dict[str, int] = defaultdict(int)
        self.period_s: dict[str, float] = defaultdict(float)  # time between consecutive same-mode batches
        self.periods: dict[str, int] = defaultdict(int)
        self._last_scheduled: tuple = (None, 0.0)  # (mode, when) of the batch scheduled last
        self._sync: Callable[[], None] = lambda: None

    def attach(self, scheduler) -> None:
        """Time this scheduler's steps from now on; call it on the scheduler thread (Engine.call)."""
        worker = scheduler.runner.worker
        if worker.device.type == "cuda":
            self._sync = functools.partial(torch.cuda.synchronize, worker.device)
        batcher, outputs = scheduler.batcher, scheduler.outputs
        batcher.get_next_batch_to_run = self._timed("schedule", batcher.get_next_batch_to_run,
                                                    mode_of=self._scheduled)
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

    def _scheduled(self, args, batch):
        """The mode of a scheduled batch (None: nothing to run); counts its rows and the period since the last
        batch when that one had the same mode."""
        if batch is None:
            self._last_scheduled = (None, 0.0)
            return None
        mode, now = batch.mode.value, time.perf_counter()
        self.rows[mode] += len(batch.reqs)
        self.scheduled[mode] += 1
        last_mode, last_at = self._last_scheduled
        if last_mode == mode:
            self.period_s[mode] += now - last_at
            self.periods[mode] += 1
        self._last_scheduled = (mode, now)
        return batch.mode

    def report(self) -> dict:
        """Per batch mode: steps, mean milliseconds per step of each phase, their sum, forward's share, rows per
        step, and the step period with its ratio to the forward (`step_over_forward`)."""
        out = {}
        for mode, seconds in sorted(self.seconds.items()):
            steps = self.steps[mode]
            if not steps:
                continue
            row = {"steps": steps, **{f"{p}_ms": seconds[p] * 1000 / steps for p in PHASES}}
            row["total_ms"] = sum(row[f"{p}_ms"] for p in PHASES)
            row["forward_share"] = row["forward_ms"] / row["total_ms"] if row["total_ms"] else 0.0
            row["rows_per_step"] = self.rows[mode] / max(self.scheduled[mode], 1)
            periods = self.periods[mode]
            row["step_ms"] = self.period_s[mode] * 1000 / periods if periods else None
            row["step_over_forward"] = (row["step_ms"] / row["forward_ms"]
                                        if periods and row["forward_ms"] else None)
            out[mode] = row
        return out


def _work_mode(args, out):
    return args[0].forward_batch.mode


def format_report(report: dict) -> str:
    """The report as a table: one row per batch mode, milliseconds per step."""
    lines = [f"{'mode':<8} {'steps':>6} {'rows':>6} " + " ".join(f"{p:>9}" for p in PHASES)
             + f" {'sum ms':>8} {'fwd %':>6} {'step ms':>8} {'step/fwd':>8}"]
    for mode, row in report.items():
        step = f"{row['step_ms']:>8.2f} {row['step_over_forward']:>8.2f}" if row.get("step_ms") else f"{'-':>8} {'-':>8}"
        lines.append(f"{mode:<8} {row['steps']:>6} {row['rows_per_step']:>6.1f} "
                     + " ".join(f"{row[p + '_ms']:>9.2f}" for p in PHASES)
                     + f" {row['total_ms']:>8.2f} {100 * row['forward_share']:>6.1f} {step}")
    return "\n".join(lines)
