"""`tandem planner`: watch a router and its workers against SLO targets and export how many prefill and
decode workers the load needs (tandem_planner_desired_replicas{role}). On Kubernetes an HPA or KEDA reads it
and scales the Deployments; under `tandem up --planner` the launcher acts on it itself."""

from __future__ import annotations

import argparse
import logging
import time

from tandem.common.flags import add_flags, from_flags
from tandem.common.planner.config import PlannerConfig
from tandem.common.planner.watch import PlannerMetrics, Watcher

logger = logging.getLogger(__name__)


def serve(config: PlannerConfig) -> None:
    """Decide every interval until interrupted, serving the decisions on --metrics-port."""
    metrics = PlannerMetrics()
    if config.metrics_port is not None:
        from tandem.common.telemetry.metrics_server import start_metrics_server

        server = start_metrics_server(metrics.registry, config.metrics_host, config.metrics_port)
        print(f"tandem planner metrics on http://{config.metrics_host}:{server.port}/metrics", flush=True)
    watcher = Watcher(config, metrics)
    print(f"tandem planner watching {config.router_url} (TTFT <= {config.ttft_slo_ms:g} ms, ITL <= "
          f"{config.itl_slo_ms:g} ms at p{config.slo_quantile * 100:g})", flush=True)
    while True:
        started = time.monotonic()
        decisions = watcher.tick()
        if decisions:
            logger.info("planner: %s", ", ".join(f"{d.role} {d.desired} ({d.reason})" for d in decisions.values()))
        time.sleep(max(0.0, config.interval_s - (time.monotonic() - started)))


def run(args: argparse.Namespace) -> int:
    serve(from_flags(PlannerConfig, args).validate())
    return 0


def add_planner_args(p: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    add_flags(p, PlannerConfig, title="planner", env_prefix="TANDEM_PLANNER_", exclude=exclude)


def register(subparsers) -> None:
    p = subparsers.add_parser("planner", help="size the prefill and decode pools from a router's metrics against "
                                              "TTFT/ITL targets; export the plan as Prometheus metrics")
    add_planner_args(p)
    p.set_defaults(func=run)
