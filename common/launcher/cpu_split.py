"""`tandem up --cpu-split`: which CPUs each worker runs on, so that workers sharing a small machine do not each
start a thread per core and thrash (a 1P+1D pair on 2 cores: four busy threads on two cores).

auto: when every worker is one process (no --tp-size/--pp-size/--dp-size > 1, no --planner) and neither
--cpu-affinity nor --num-threads was given, the usable CPUs are cut into consecutive, disjoint slices, one per worker,
as even as they go; decode workers take the spare CPUs first (they run every step, a prefill only when prompts
arrive). Fewer CPUs than workers: nothing is pinned. off: nothing is pinned. P:D: each prefill worker gets P CPUs,
each decode worker D (prefill/decode stacks only)."""

from __future__ import annotations

from typing import Optional

from tandem.common.cpu_affinity import format_cpu_list, split_cpus
from tandem.common.flags import ConfigError


def parse_split(spec: str) -> Optional[tuple[int, int]]:
    """auto/off -> None; "P:D" -> (P, D)."""
    if spec in ("auto", "off"):
        return None
    prefill, sep, decode = spec.partition(":")
    if not (sep and prefill.isdigit() and decode.isdigit() and int(prefill) > 0 and int(decode) > 0):
        raise ConfigError(f"--cpu-split {spec!r}: auto, off, or P:D (CPUs per prefill and per decode worker, "
                          "both >= 1)")
    return int(prefill), int(decode)


def worker_cpus(spec: str, names: list[str], usable: list[int], pinned_by_flags: bool,
                multi_process: bool) -> dict[str, str]:
    """Worker name -> its --cpu-affinity list; {} pins nothing. `pinned_by_flags`: --cpu-affinity or --num-threads
    was given for every worker; `multi_process`: a worker is several processes (TP/PP/DP) or the planner adds some."""
    counts = parse_split(spec)
    if spec == "off" or (spec == "auto" and (pinned_by_flags or multi_process or len(usable) < len(names))):
        return {}
    if counts is not None:
        if pinned_by_flags:
            raise ConfigError(f"--cpu-split {spec} gives each worker its CPUs; drop --cpu-affinity/--num-threads")
        if any(name.startswith("worker-") for name in names):
            raise ConfigError(f"--cpu-split {spec} sizes prefill and decode workers; unified ones take auto or off")
        sizes = [counts[0] if name.startswith("prefill-") else counts[1] for name in names]
    else:
        share, spare = divmod(len(usable), len(names))
        # Spare CPUs to the decode workers first, then the others, in order.
        order = sorted(range(len(names)), key=lambda i: not names[i].startswith("decode-"))
        sizes = [share] * len(names)
        for i in order[:spare]:
            sizes[i] += 1
    try:
        slices = split_cpus(usable, sizes)
    except ValueError as e:
        raise ConfigError(f"--cpu-split {spec}: {e}") from None
    return {name: format_cpu_list(cpus) for name, cpus in zip(names, slices)}
