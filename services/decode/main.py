"""`tandem decode`: the decode worker's start-up — the engine with the decode scheduler, whose KV manager receives
prompt KV from prefill workers through NIXL, served over the SglangScheduler gRPC API."""

from __future__ import annotations

import argparse
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
from tandem.services.decode.allow_list import BootstrapAllowList
from tandem.services.decode.servicer import DecodeServicer

if TYPE_CHECKING:
    from tandem.common.scheduler.parts import SchedulerParts
    from tandem.services.decode.scheduler import DecodeScheduler


def run(args: argparse.Namespace) -> int:
    setup_tracing("tandem-decode")
    worker = worker_config_from_args(args)
    config = engine_config_from_args(args).check_role("decode")
    transfer = transfer_config_from_args(args)
    # With --dp-size N each replica gets these transfer flags, its own KV pool and NIXL agent.
    dp_role = DPRole(Role.DECODE, from_flags(TransferFlags, args), transfer.engine_id)
    return serve_role(args, Role.DECODE, config, worker, transfer.tls,
                      lambda: _serve(args, config, worker, transfer), dp_role)


def _serve(args: argparse.Namespace, config: EngineConfig, worker: WorkerConfig, transfer: TransferConfig) -> int:
    """One decode engine (all its TP/PP ranks) served on the worker's port."""
    # torch, which a --dp-size N controller never loads
    from tandem.common.engine import Engine
    from tandem.common.transfer.kv_manager import DecodeKVManager, KVShard
    from tandem.services.decode.scheduler import DecodeScheduler

    allowed = from_flags(TransferFlags, args).allowed_bootstrap
    metrics = WorkerMetrics(Role.DECODE)

    def decode_scheduler(parts: "SchedulerParts") -> "DecodeScheduler":
        pool = parts.kv_pool
        kv_manager = DecodeKVManager(KVLayout.of_pool(pool), pool.k_buffers, pool.v_buffers, transfer,
                                      KVShard.of_parts(parts))
        return DecodeScheduler(parts, kv_manager)

    engine = Engine(config, enable_kv_events=True, scheduler_factory=decode_scheduler, metrics=metrics,
                    can_release_kv=False)  # the pool is registered with NIXL
    engine.control.follow_version(engine.scheduler.kv_manager.set_weight_version)
    info = worker_info(args, Role.DECODE)
    servicer = DecodeServicer(engine, info, metrics, profile_dir=worker.profile_dir,
                              allowed_bootstrap=BootstrapAllowList(allowed) if allowed else None)
    return serve_engine(engine, servicer, metrics, worker, transfer.tls)


def register(subparsers) -> None:
    p = subparsers.add_parser("decode", help="serve decode legs; receive prompt KV from prefill workers via NIXL")
    add_worker_args(p)
    add_transfer_args(p)
    p.set_defaults(func=run)
