"""`tandem prefill`: the prefill worker — SglangScheduler gRPC server plus the bootstrap server."""

from __future__ import annotations

import argparse
import os


def run(args: argparse.Namespace) -> int:
    from common.rpc.disagg import run_disaggregated_worker
    from services.prefill.scheduler import PrefillScheduler

    return run_disaggregated_worker(args, "prefill", PrefillScheduler, bootstrap_port=args.bootstrap_port)


def register(subparsers) -> None:
    from common.rpc.unified_worker import add_worker_args
    from common.transfer.worker_args import add_transfer_args

    p = subparsers.add_parser("prefill", help="serve prefill legs; push their KV to decode workers via NIXL")
    add_worker_args(p)
    p.add_argument("--bootstrap-port", type=int, default=int(os.environ.get("TANDEM_BOOTSTRAP_PORT", "8998")),
                   help="port of the bootstrap server decode workers register with (0 picks a free one) "
                        "[env TANDEM_BOOTSTRAP_PORT]")
    add_transfer_args(p)
    p.set_defaults(func=run)
