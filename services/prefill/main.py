"""`tandem prefill`: the prefill worker's start-up — the engine with the prefill scheduler, whose KV manager runs the
bootstrap server decode workers register with, served over the SglangScheduler gRPC API."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from tandem.common.config import (EngineConfig, TransferFlags, WorkerConfig, add_transfer_args, add_worker_args,
                                  engine_config_from_args, worker_config_from_args)
from tandem.common.dp.serve import DPRole
from tandem.common.flags import from_flags
from tandem.common.roles import Role
from tandem.common.rpc.server import serve_engine, worker_info
from tandem.common.rpc.startup import serve_role
from tandem.common.telemetry.metrics import WorkerMetrics
from tandem.common.telemetry.tracing import setup_tracing
from tandem.common.transfer.messages import KVLayout, TransferConfig, transfer_config_from_args
from tandem.services.prefill.servicer import PrefillServicer

if TYPE_CHECKING:
    from tandem.common.scheduler.parts import SchedulerParts
    from tandem.services.prefill.scheduler import PrefillScheduler

logger = logging.getLogger(__name__)


def run(args: argparse.Namespace) -> int:
    setup_tracing("tandem-prefill")
    worker = worker_config_from_args(args)
    config = engine_config_from_args(args).check_role("prefill")
    transfer = transfer_config_from_args(args, args.bootstrap_port)
    # With --dp-size N each replica gets these transfer flags; the bootstrap proxy listens on --bootstrap-port.
    dp_role = DPRole(Role.PREFILL, from_flags(TransferFlags, args), transfer.engine_id, args.host, args.bootstrap_port)
    return serve_role(args, Role.PREFILL, config, worker, transfer.tls,
                      lambda: _serve(args, config, worker, transfer), dp_role)


def _serve(args: argparse.Namespace, config: EngineConfig, worker: WorkerConfig, transfer: TransferConfig) -> int:
    """One prefill engine (all its TP/PP ranks) served on the worker's port."""
    # torch, which a --dp-size N controller never loads
    from tandem.common.engine import Engine
    from tandem.common.transfer.kv_manager import KVShard, PrefillKVManager
    from tandem.services.prefill.scheduler import PrefillScheduler

    metrics = WorkerMetrics(Role.PREFILL)

    def prefill_scheduler(parts: "SchedulerParts") -> "PrefillScheduler":
        pool = parts.kv_pool
        kv_manager = PrefillKVManager(KVLayout.of_pool(pool), pool.k_buffers, pool.v_buffers, transfer,
                                       KVShard.of_parts(parts))
        return PrefillScheduler(parts, kv_manager)

    engine = Engine(config, enable_kv_events=True, scheduler_factory=prefill_scheduler, metrics=metrics,
                    can_release_kv=False)  # the pool is registered with NIXL
    engine.control.follow_version(engine.scheduler.kv_manager.set_weight_version)
    bootstrap_port = engine.scheduler.kv_manager.bootstrap_port
    info = worker_info(args, Role.PREFILL, disaggregation_bootstrap_port=bootstrap_port)
    # Printed, as the 'listening' line is, whatever the log level: a launcher that passed port 0 reads it.
    print(f"tandem prefill bootstrap server listening on {args.host}:{bootstrap_port}", flush=True)
    servicer = PrefillServicer(engine, info, metrics, profile_dir=worker.profile_dir)
    return serve_engine(engine, servicer, metrics, worker, transfer.tls)


def register(subparsers) -> None:
    p = subparsers.add_parser("prefill", help="serve prefill legs; push their KV to decode workers via NIXL")
    add_worker_args(p)
    add_transfer_args(p, prefill=True)
    p.set_defaults(func=run)
