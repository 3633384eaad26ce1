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
    (extend, decode, mixed). Phases on different threads (the overlap loop's forward and sample run on the model thread)
    overlap in time, so their sum may exceed a step's wall time. The step period (`step_ms`) is the wall time
    from one batch's sampled tokens to the next's, when both batches have the same mode: what a step really costs
    on the thread that runs the model, waits for the scheduler and other threads' GIL time included;
    `step_over_forward` divides it by the forwards of the same steps."""

    def __init__(self):
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(PHASES, 0.0))
        self.steps: dict[str, int] = defaultdict(int)
        self.rows: dict[str, int] = defaultdict(int)  # requests per batch, summed over the batches scheduled
        self.scheduled: dict[str, int] = defaultdict(int)
        self.period_s: dict[str, float] = defaultdict(float)  # sampled-to-sampled time of consecutive same-mode steps
        self.periods: dict[str, int] = defaultdict(int)
        self.paired_forward_s: dict[str, float] = defaultdict(float)  # the forwards of the steps with a period
        self._last_forward = 0.0  # the forward of the batch that samples next (both on the model thread)
        self._last_sampled: tuple = (None, 0.0)  # (mode, when) of the batch that sampled last
        # Decode steps by batch size: [steps, forward seconds, period seconds, periods] ("at batch 32").
        self.decode_by_rows: dict[int, list] = defaultdict(lambda: [0, 0.0, 0.0, 0])
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
                                                   mode_of=lambda args, out: _batch_mode(args[0]))

    def _timed(self, phase: str, fn: Callable, mode_of: Callable, sync: bool = False, count: bool = False):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if sync:
                self._sync()
            mode = mode_of(args, out)
            if mode is not None:  # an idle poll of the scheduler is no step
                end = time.perf_counter()
                self.seconds[mode][phase] += end - start
                if phase == "forward":
                    self._last_forward = end - start
                    if mode == "decode":
                        self.decode_by_rows[args[0].forward_batch.batch_size][1] += end - start
                if count:
                    self._sampled(mode, end, args[0].forward_batch.batch_size)
            return out
        return timed

    def _scheduled(self, args, batch):
        """The mode of a scheduled batch (None: nothing to run), counting its rows."""
        if batch is None:
            return None
        mode = _batch_mode(batch)
        self.rows[mode] += len(batch.reqs)
        self.scheduled[mode] += 1
        return mode

    def _sampled(self, mode: str, now: float, rows: int) -> None:
        """A step of `mode` ended: count it, and the period since the last one when that had the same mode."""
        self.steps[mode] += 1
        by_rows = self.decode_by_rows[rows] if mode == "decode" else [0, 0.0, 0.0, 0]
        by_rows[0] += 1
        last_mode, last_at = self._last_sampled
        if last_mode == mode:
            self.period_s[mode] += now - last_at
            self.periods[mode] += 1
            self.paired_forward_s[mode] += self._last_forward
            by_rows[2] += now - last_at
            by_rows[3] += 1
        self._last_sampled = (mode, now)

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
            paired = self.paired_forward_s[mode]  # the same steps' forwards: a slow first step is in neither
            row["step_over_forward"] = self.period_s[mode] / paired if periods and paired else None
            out[mode] = row
        if "decode" in out:
            out["decode"]["by_batch_size"] = {
                rows: {"steps": steps, "forward_ms": fwd * 1000 / steps,
                       "step_ms": period * 1000 / periods if periods else None}
                for rows, (steps, fwd, period, periods) in sorted(self.decode_by_rows.items()) if steps}
        return out


def _work_mode(args, out) -> str:
    work = args[0]
    return "mixed" if work.decode_rows else work.forward_batch.mode.value


def _batch_mode(batch) -> str:
    """extend, decode, or mixed (an extend carrying the running requests' decode step, --enable-mixed-chunk)."""
    return "mixed" if batch.decode_rows else batch.mode.value


def format_report(report: dict) -> str:
    """The report as a table: one row per batch mode, milliseconds per step."""
    lines = [f"{'mode':<8} {'steps':>6} {'rows':>6} " + " ".join(f"{p:>9}" for p in PHASES)
             + f" {'sum ms':>8} {'fwd %':>6} {'step ms':>8} {'step/fwd':>8}"]
    for mode, row in report.items():
        step = f"{row['step_ms']:>8.2f} {row['step_over_forward']:>8.2f}" if row.get("step_ms") else f"{'-':>8} {'-':>8}"
        lines.append(f"{mode:<8} {row['steps']:>6} {row['rows_per_step']:>6.1f} "
                     + " ".join(f"{row[p + '_ms']:>9.2f}" for p in PHASES)
                     + f" {row['total_ms']:>8.2f} {100 * row['forward_share']:>6.1f} {step}")
    sizes = report.get("decode", {}).get("by_batch_size", {})
    busiest = sorted(sizes.items(), key=lambda kv: -kv[1]["steps"])[:4]
    for rows, size in sorted(busiest):
        step = f"{size['step_ms']:.2f}" if size["step_ms"] else "-"
        lines.append(f"  decode at batch {rows}: {size['steps']} steps, forward {size['forward_ms']:.2f} ms, "
                     f"step {step} ms")
    return "\n".join(lines)
