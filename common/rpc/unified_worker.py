"""`tandem worker`: one process that prefills and decodes, serving the SglangScheduler gRPC API."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from common.config import add_engine_args, engine_config_from_args
from common.errors import InvalidRequestError
from common.roles import Role
from common.rpc.server import DEFAULT_DRAIN_TIMEOUT_S, serve_engine, worker_info
from common.rpc.servicer import SchedulerServicer
from common.telemetry.metrics import WorkerMetrics
from common.telemetry.metrics_server import add_metrics_args
from common.telemetry.tracing import setup_tracing

logger = logging.getLogger(__name__)


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    """Flags every gRPC worker shares (the prefill and decode workers reuse this)."""
    parser.add_argument("--host", default=os.environ.get("TANDEM_HOST", "127.0.0.1"),
                        help="address to listen on [env TANDEM_HOST]")
    parser.add_argument("--port", type=int, default=int(os.environ.get("TANDEM_PORT", "30000")),
                        help="gRPC port (0 picks a free one) [env TANDEM_PORT]")
    parser.add_argument("--served-model-name", default=os.environ.get("TANDEM_SERVED_MODEL_NAME"),
                        help="model name reported to gateways (default: the model directory's name) "
                             "[env TANDEM_SERVED_MODEL_NAME]")
    parser.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                        help="seconds to let in-flight requests finish on SIGTERM")
    add_metrics_args(parser)
    add_engine_args(parser)


class UnifiedServicer(SchedulerServicer):
    """A unified worker prefills and decodes each request itself: a request paired for PD is a mistake."""

    def check_role(self, request) -> None:
        if request.HasField("disaggregated_params"):
            raise InvalidRequestError(
                "disaggregated_params: this worker is unified (prefill and decode in one process); send "
                "disaggregated requests to a prefill/decode worker pair", "disaggregated_params")


def run(args: argparse.Namespace) -> int:
    from common.engine import Engine

    setup_tracing("tandem-unified")
    config = engine_config_from_args(args)
    metrics = WorkerMetrics(Role.UNIFIED)
    engine = Engine(config, enable_kv_events=True, metrics=metrics)
    info = worker_info(args, Role.UNIFIED)
    return serve_engine(engine, UnifiedServicer(engine, info, metrics), metrics, args)


def register(subparsers) -> None:
    p = subparsers.add_parser("worker", help="serve one model (prefill + decode) over the SglangScheduler gRPC API")
    add_worker_args(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem-worker")
    parser.add_argument("--log-level", default="warning")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":  # python -m common.rpc.unified_worker worker --model DIR --port N
    sys.exit(main())
