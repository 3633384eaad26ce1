"""Merging expert-distribution dumps of several engines (data-parallel replicas, a router's workers): counts add up,
each engine's own dump is kept beside the sum. Plain JSON data, no torch: a DP controller and the router use it."""

from __future__ import annotations

from typing import Optional


def add_counts(a: list, b: list) -> list:
    """Element-wise sum of two equally shaped nested lists of numbers; ValueError naming the shapes otherwise."""
    if len(a) != len(b):
        raise ValueError(f"counts of different shapes ({len(a)} vs {len(b)} rows)")
    out = []
    for x, y in zip(a, b):
        if isinstance(x, list) != isinstance(y, list):
            raise ValueError("counts of different shapes (a list beside a number)")
        out.append(add_counts(x, y) if isinstance(x, list) else x + y)
    return out


def merge_dumps(dumps: list[dict], parts_key: Optional[str] = None) -> dict:
    """One dump for several engines' (the recorder's dump or an earlier merge): num_steps and logical_count summed,
    recording when any records, and with `parts_key` the dumps themselves under it. Engines of different models
    (counts of different shapes) are a ValueError."""
    if not dumps:
        raise ValueError("no dumps to merge")
    counts = dumps[0]["logical_count"]
    for dump in dumps[1:]:
        counts = add_counts(counts, dump["logical_count"])
    modes = sorted({d["mode"] for d in dumps})
    merged = {"mode": modes[0] if len(modes) == 1 else ",".join(modes),
              "recording": any(d["recording"] for d in dumps),
              "num_steps": sum(d["num_steps"] for d in dumps), "logical_count": counts}
    if parts_key is not None:
        merged[parts_key] = dumps
    return merged
