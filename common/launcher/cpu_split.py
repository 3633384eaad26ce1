"""`tandem up --cpu-split`: how workers sharing a small machine share its CPUs, so that they do not each start a
thread per core and thrash (a 1P+1D pair on 2 cores: four spinning OpenMP threads on two cores).

Every policy but off cuts the usable CPUs into one share per worker, as even as they go, spare CPUs to the decode
workers first (they run every step; a prefill only when prompts arrive).
auto: each worker runs as many torch threads as its share (--num-threads), the kernel still free to place them;
  only when every worker is one process (no --tp-size/--pp-size/--dp-size > 1, no --planner), neither
  --cpu-affinity nor --num-threads was given, and there are at least as many CPUs as workers.
pin: as auto, and each worker is also pinned to its own consecutive slice (--cpu-affinity).
P:D: pinned, each prefill worker to P CPUs and each decode worker to D (prefill/decode stacks only).
off: nothing is set; each worker's torch takes every CPU.
Measured on 2 shared cores in docs/performance.md ("Served PD on a small machine")."""

from __future__ import annotations

from typing import Optional

from tandem.common.cpu_affinity import format_cpu_list, split_cpus
from tandem.common.flags import ConfigError

POLICIES = ("auto", "pin", "off")


def parse_split(spec: str) -> Optional[tuple[int, int]]:
    """A policy name -> None; "P:D" -> (P, D)."""
    if spec in POLICIES:
        return None
    prefill, sep, decode = spec.partition(":")
    if not (sep and prefill.isdigit() and decode.isdigit() and int(prefill) > 0 and int(decode) > 0):
        raise ConfigError(f"--cpu-split {spec!r}: auto, pin, off, or P:D (CPUs per prefill and per decode worker, "
                          "both >= 1)")
    return int(prefill), int(decode)


def even_shares(names: list[str], cpus: int) -> list[int]:
    share, spare = divmod(cpus, len(names))
    sizes = [share] * len(names)
    for i in sorted(range(len(names)), key=lambda i: not names[i].startswith("decode-"))[:spare]:
        sizes[i] += 1
    return sizes


def worker_flags(spec: str, names: list[str], usable: list[int], sized_by_flags: bool,
                 multi_process: bool) -> dict[str, list[str]]:
    """Worker name -> the flags that give it its CPUs; {} sets nothing. `sized_by_flags`: --cpu-affinity or
    --num-threads was given for every worker; `multi_process`: a worker is several processes (TP/PP/DP) or the
    planner adds some."""
    counts = parse_split(spec)
    if counts is None and (spec == "off" or sized_by_flags or multi_process or len(usable) < len(names)):
        return {}
    if counts is not None:
        if sized_by_flags:
            raise ConfigError(f"--cpu-split {spec} gives each worker its CPUs; drop --cpu-affinity/--num-threads")
        if any(name.startswith("worker-") for name in names):
            raise ConfigError(f"--cpu-split {spec} sizes prefill and decode workers; unified ones take auto, pin "
                              "or off")
        sizes = [counts[0] if name.startswith("prefill-") else counts[1] for name in names]
    else:
        sizes = even_shares(names, len(usable))
    if spec == "auto":
        return {name: ["--num-threads", str(size)] for name, size in zip(names, sizes)}
    try:
        slices = split_cpus(usable, sizes)
    except ValueError as e:
        raise ConfigError(f"--cpu-split {spec}: {e}") from None
    return {name: ["--cpu-affinity", format_cpu_list(cpus)] for name, cpus in zip(names, slices)}
