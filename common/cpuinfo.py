"""What /proc/cpuinfo says about this machine's CPU: the one reader of it, for the kernels' choice and build cache
and for the benchmarks' reports. Where it cannot be read (not Linux), every answer is empty or unknown."""

from __future__ import annotations

import functools


@functools.cache
def cpu_fields() -> dict[str, str]:
    """This machine's first processor's fields; empty where /proc/cpuinfo cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return {}


def parse_cpuinfo(text: str) -> dict[str, str]:
    """The first processor's `key: value` lines (every processor of one machine reports the same model and
    flags)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block ended
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags (what -march=native compiles for)."""
    return frozenset(cpu_fields().get("flags", "").split())


def cpu_model_name() -> str:
    return cpu_fields().get("model name", "unknown")


def cpu_vendor_family() -> tuple[str, int]:
    """(vendor_id, cpu family); ("", -1) where they cannot be read."""
    fields = cpu_fields()
    try:
        return fields.get("vendor_id", ""), int(fields.get("cpu family", "-1"))
    except ValueError:
        return fields.get("vendor_id", ""), -1
