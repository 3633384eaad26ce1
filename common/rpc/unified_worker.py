"""`tandem worker`: one process that prefills and decodes, serving the SglangScheduler gRPC API."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Optional

from common.config import add_engine_args, engine_config_from_args
from common.rpc.server import DEFAULT_DRAIN_TIMEOUT_S, serve
from common.rpc.servicer import SchedulerServicer, WorkerInfo
from common.telemetry.metrics import WorkerMetrics, read_scheduler_stats
from common.telemetry.metrics_server import MetricsServer, add_metrics_args, maybe_start_metrics_server
from common.telemetry.tracing import setup_tracing, shutdown_tracing

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


def worker_info(args: argparse.Namespace, role: str) -> WorkerInfo:
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model_path))
    server_args = {k: v for k, v in vars(args).items() if k != "func"}
    # SGLang's server-args names, for gateways that read them.
    server_args.update(served_model_name=name, tp_size=1, dp_size=1,
                       disaggregation_mode="null" if role == "unified" else role)
    return WorkerInfo(served_model_name=name, role=role, server_args=server_args)


def start_worker_metrics(engine, role: str, args: argparse.Namespace
                         ) -> tuple[WorkerMetrics, Optional[MetricsServer]]:
    """The worker's metrics, fed by its scheduler, and their /metrics server when --metrics-port asks."""
    metrics = WorkerMetrics(role)
    metrics.watch_scheduler(lambda: engine.call(read_scheduler_stats, 2.0))
    server = maybe_start_metrics_server(metrics.registry, args.host, args)
    if server is not None:
        print(f"tandem {role} worker metrics on http://{args.host}:{server.port}/metrics", flush=True)
    engine.scheduler.metrics = metrics
    return metrics, server


def run(args: argparse.Namespace) -> int:
    from common.engine import Engine

    setup_tracing("tandem-unified")
    config = engine_config_from_args(args)
    info = worker_info(args, "unified")
    engine = Engine(config, enable_kv_events=True)
    return serve_engine(engine, SchedulerServicer, info, args)


def serve_engine(engine, servicer_cls, info: WorkerInfo, args: argparse.Namespace) -> int:
    """Serve a loaded engine until signalled, then close its metrics server, the engine and tracing."""
    metrics_server = None
    try:
        metrics, metrics_server = start_worker_metrics(engine, info.role, args)
        asyncio.run(serve(servicer_cls(engine, info, metrics), args.host, args.port, args.drain_timeout))
    finally:
        if metrics_server is not None:
            metrics_server.close()
        engine.shutdown()
        shutdown_tracing()
    return 0


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
