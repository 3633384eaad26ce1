"""`tandem decode`: the decode worker — receives prompt KV via NIXL and streams generated tokens."""

from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> int:
    from common.rpc.disagg import run_disaggregated_worker
    from services.decode.scheduler import DecodeScheduler

    return run_disaggregated_worker(args, "decode", DecodeScheduler)


def register(subparsers) -> None:
    from common.rpc.unified_worker import add_worker_args
    from common.transfer.worker_args import add_transfer_args

    p = subparsers.add_parser("decode", help="serve decode legs; receive prompt KV from prefill workers via NIXL")
    add_worker_args(p)
    add_transfer_args(p)
    p.set_defaults(func=run)
