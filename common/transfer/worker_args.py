"""CLI flags shared by the prefill and decode workers: the KV transfer knobs."""

from __future__ import annotations

import argparse
import os
import socket
import uuid

from common.transfer.messages import TransferConfig


def _env(name: str, default):
    value = os.environ.get(name)
    return type(default)(value) if value is not None else default


def add_transfer_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV transfer")
    group.add_argument("--bootstrap-timeout", type=float, default=_env("TANDEM_BOOTSTRAP_TIMEOUT", 30.0),
                       help="seconds a room waits for its peer (destination / registration) "
                            "[env TANDEM_BOOTSTRAP_TIMEOUT]")
    group.add_argument("--transfer-timeout", type=float, default=_env("TANDEM_TRANSFER_TIMEOUT", 120.0),
                       help="seconds from transfer start to completion [env TANDEM_TRANSFER_TIMEOUT]")
    group.add_argument("--heartbeat-interval", type=float, default=_env("TANDEM_HEARTBEAT_INTERVAL", 1.0),
                       help="seconds between decode->prefill heartbeats [env TANDEM_HEARTBEAT_INTERVAL]")
    group.add_argument("--heartbeat-max-missed", type=int, default=_env("TANDEM_HEARTBEAT_MAX_MISSED", 3),
                       help="missed heartbeats before a peer is declared dead [env TANDEM_HEARTBEAT_MAX_MISSED]")
    group.add_argument("--engine-id", default=os.environ.get("TANDEM_ENGINE_ID"),
                       help="this worker's id in the transfer layer (default: host:port) [env TANDEM_ENGINE_ID]")


def transfer_config_from_args(args: argparse.Namespace, bootstrap_port: int = 0) -> TransferConfig:
    # With --port 0 the port is not known yet and would not tell two workers on one host apart.
    engine_id = args.engine_id or (f"{socket.gethostname()}:{args.port}" if args.port
                                   else f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}")
    return TransferConfig(
        engine_id=engine_id, bootstrap_host=args.host, bootstrap_port=bootstrap_port,
        bootstrap_timeout_s=args.bootstrap_timeout, transfer_timeout_s=args.transfer_timeout,
        heartbeat_interval_s=args.heartbeat_interval, heartbeat_max_missed=args.heartbeat_max_missed)
