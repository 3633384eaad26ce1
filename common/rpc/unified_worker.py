"""`tandem worker`: one process that prefills and decodes, serving the SglangScheduler gRPC API."""

from __future__ import annotations

import argparse
import logging
import sys

from tandem.common.config import (EngineConfig, TlsConfig, WorkerConfig, add_worker_args, engine_config_from_args,
                                  tls_config_from_args, worker_config_from_args)
from tandem.common.errors import InvalidRequestError
from tandem.common.flags import refuse_abbreviations
from tandem.common.roles import Role
from tandem.common.rpc.server import serve_engine, worker_info
from tandem.common.rpc.servicer import SchedulerServicer
from tandem.common.rpc.startup import serve_role
from tandem.common.telemetry.metrics import WorkerMetrics
from tandem.common.telemetry.tracing import setup_tracing

logger = logging.getLogger(__name__)


class UnifiedServicer(SchedulerServicer):
    """A unified worker prefills and decodes each request itself: a request paired for PD is a mistake."""

    def check_role(self, request) -> None:
        if request.HasField("disaggregated_params"):
            raise InvalidRequestError(
                "disaggregated_params: this worker is unified (prefill and decode in one process); send "
                "disaggregated requests to a prefill/decode worker pair", "disaggregated_params")


def run(args: argparse.Namespace) -> int:
    setup_tracing("tandem-unified")
    worker = worker_config_from_args(args)
    config = engine_config_from_args(args)
    tls = tls_config_from_args(args)
    return serve_role(args, Role.UNIFIED, config, worker, tls, lambda: _serve(args, config, worker, tls))


def _serve(args: argparse.Namespace, config: EngineConfig, worker: WorkerConfig, tls: TlsConfig) -> int:
    """One engine (all its TP/PP ranks) served on the worker's port."""
    from tandem.common.engine import Engine  # torch, which a --dp-size N controller never loads

    metrics = WorkerMetrics(Role.UNIFIED)
    engine = Engine(config, enable_kv_events=True, metrics=metrics)
    info = worker_info(args, Role.UNIFIED)
    servicer = UnifiedServicer(engine, info, metrics, profile_dir=worker.profile_dir)
    return serve_engine(engine, servicer, metrics, worker, tls)


def register(subparsers) -> None:
    p = subparsers.add_parser("worker", help="serve one model (prefill + decode) over the SglangScheduler gRPC API")
    add_worker_args(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem-worker")
    parser.add_argument("--log-level", default="warning")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = refuse_abbreviations(parser).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":  # python -m tandem.common.rpc.unified_worker worker --model DIR --port N
    sys.exit(main())
