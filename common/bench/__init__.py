"""Benchmarks: `tandem bench offline` (engine throughput) and `tandem bench serve` (any OpenAI-compatible endpoint)."""

from __future__ import annotations

import argparse
import json


def write_results_json(path: str, args: argparse.Namespace, rows: list) -> None:
    """A bench command's --output-json: its flags (less the handler) and its result rows."""
    with open(path, "w") as f:
        json.dump({"config": vars(args) | {"func": None}, "results": rows}, f, indent=2, default=str)
