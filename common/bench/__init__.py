"""Benchmarks: `tandem bench offline` (engine throughput) and `tandem bench serve` (any OpenAI-compatible endpoint)."""

from __future__ import annotations

import argparse
import json


def write_results_json(path: str, args: argparse.Namespace, rows: list, **extra) -> None:
    """A bench command's --output-json: its flags (less the handler), its result rows and any `extra` fields that
    are not None (e.g. the machine the roofline was measured on)."""
    document = {"config": vars(args) | {"func": None}, "results": rows}
    document |= {key: value for key, value in extra.items() if value is not None}
    with open(path, "w") as f:
        json.dump(document, f, indent=2, default=str)


def add_bench_parser(bench_subparsers, name: str, help: str,
                     model_help: str = "model dir; unset: the built-in small model, created on first use"
                     ) -> argparse.ArgumentParser:
    """A `tandem bench` command's parser (defaults shown in --help) with the engine benches' model flag."""
    p = bench_subparsers.add_parser(name, help=help, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", "--model-path", dest="model", default=None, help=model_help)
    return p
