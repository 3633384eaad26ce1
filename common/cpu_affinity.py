"""CPU lists ("0-3,6") for --cpu-affinity: parse, format, split among workers, and pin every thread of a process."""

from __future__ import annotations

import os


def parse_cpu_list(text: str) -> list[int]:
    """"0-3,6" -> [0, 1, 2, 3, 6]; a malformed list or an empty one is a ValueError."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{text!r}: CPU numbers and ranges, comma-separated (e.g. 0-3,6)")
        lo, hi = int(first), int(last or first)
        if hi < lo:
            raise ValueError(f"{text!r}: the range {part.strip()} runs backwards")
        cpus.update(range(lo, hi + 1))
    return sorted(cpus)


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 3, 6] -> "0-3,6", the form /proc/PID/status shows (Cpus_allowed_list)."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in runs)


def usable_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def split_cpus(cpus: list[int], counts: list[int]) -> list[list[int]]:
    """Consecutive, disjoint slices of `cpus`, one of each size in `counts`."""
    if sum(counts) > len(cpus) or min(counts, default=1) < 1:
        raise ValueError(f"cannot give {counts} CPUs out of {len(cpus)} usable ({format_cpu_list(cpus)})")
    slices, start = [], 0
    for count in counts:
        slices.append(cpus[start:start + count])
        start += count
    return slices


def pin_process(cpus: list[int]) -> None:
    """Every thread this process has now (torch's OpenMP pool included, if started) and every one it starts later
    runs on `cpus`: Linux's sched_setaffinity sets one thread's mask, which new threads and children inherit."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
