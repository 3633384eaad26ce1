"""`tandem up --cpu-split`: how workers sharing a small machine share its CPUs, so that they do not each start a
thread per core and thrash (a 1P+1D pair on 2 cores: four spinning OpenMP threads on two cores).

auto, pin and P:D cut the usable CPUs into one share per worker, as even as they go, spare CPUs to the decode
workers first (they run every step; a prefill only when prompts arrive).
auto: on a machine with fewer than two CPUs per worker, a stack of prefill and decode workers shares them (below);
  otherwise each worker runs as many torch threads as its share (--num-threads), the kernel still free to place
  them. Only when every worker is one process (no --tp-size/--pp-size/--dp-size > 1, no --planner), neither
  --cpu-affinity nor --num-threads was given, and there are at least as many CPUs as workers.
shared: every worker keeps a torch thread per CPU, with OpenMP's passive wait policy (OMP_WAIT_POLICY=PASSIVE in
  its environment): a worker between two steps sleeps instead of spinning on the cores the other one computes on,
  so a prefill burst runs on every core while the decode waits for its KV, and the decode on every core between
  bursts. On 2 cores a 1P+1D pair served 762-766 tok/s this way against 706-716 with a thread each.
pin: as auto's split, and each worker is also pinned to its own consecutive slice (--cpu-affinity).
P:D: pinned, each prefill worker to P CPUs and each decode worker to D (prefill/decode stacks only).
off: nothing is set; each worker's torch takes every CPU.
Measured on 2 shared cores in docs/performance.md ("Served PD on a small machine")."""

from __future__ import annotations

from typing import Optional

from tandem.common.cpu_affinity import format_cpu_list, split_cpus
from tandem.common.flags import ConfigError

POLICIES = ("auto", "pin", "shared", "off")
SHARED_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


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


def shares_cpus(spec: str, names: list[str], usable: list[int], sized_by_flags: bool, multi_process: bool) -> bool:
    """Whether the workers share every CPU with passive OpenMP waits (`shared`, or `auto` on a small machine)."""
    if spec == "shared":
        return True
    roles = {name.split("-")[0] for name in names}
    return (spec == "auto" and not (sized_by_flags or multi_process) and {"prefill", "decode"} <= roles
            and len(names) <= len(usable) < 2 * len(names))


def worker_flags(spec: str, names: list[str], usable: list[int], sized_by_flags: bool,
                 multi_process: bool) -> dict[str, list[str]]:
    """Worker name -> the flags that give it its CPUs; {} sets nothing (shared workers get their environment
    instead, SHARED_ENV). `sized_by_flags`: --cpu-affinity or --num-threads was given for every worker;
    `multi_process`: a worker is several processes (TP/PP/DP) or the planner adds some."""
    counts = parse_split(spec)
    if counts is None and (spec == "off" or sized_by_flags or multi_process or len(usable) < len(names)
                           or shares_cpus(spec, names, usable, sized_by_flags, multi_process)):
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
