"""The /metrics HTTP endpoint for services without an HTTP server of their own (the gRPC workers), and the
--metrics-port flag that turns it on."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from prometheus_client import CollectorRegistry, start_http_server

logger = logging.getLogger(__name__)
METRICS_PORT_ENV = "TANDEM_METRICS_PORT"


@dataclass
class MetricsServer:
    host: str
    port: int  # the bound port (a free one when 0 was asked for)
    _server: object
    _thread: object

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(registry: CollectorRegistry, host: str = "0.0.0.0", port: int = 0) -> MetricsServer:
    """Serve `registry` as Prometheus text on http://host:port/metrics (any path answers) from a daemon thread;
    port 0 binds a free port (see .port). Raises OSError when the port is taken."""
    server, thread = start_http_server(port, addr=host, registry=registry)
    bound = server.server_address[1]
    logger.info("Prometheus metrics on http://%s:%d/metrics", host, bound)
    return MetricsServer(host, bound, server, thread)


def metrics_port_from_args(args) -> int:
    """The port to serve metrics on (0 = off), validated, from parsed flags or a WorkerConfig; --metrics-port
    (env TANDEM_METRICS_PORT) is WorkerConfig's flag."""
    port = getattr(args, "metrics_port", None) or 0
    if not 0 <= port <= 65535:
        raise ValueError(f"--metrics-port must be 0 (off) or a port number 1-65535, got {port}")
    return port


def maybe_start_metrics_server(registry: CollectorRegistry, host: str, args) -> Optional[MetricsServer]:
    """start_metrics_server on the --metrics-port, or None when it is 0 (off)."""
    port = metrics_port_from_args(args)
    if port == 0:
        return None
    return start_metrics_server(registry, host, port)
