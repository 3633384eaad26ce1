"""`tandem decode`: the decode worker's start-up — the engine with the decode scheduler, whose KV manager receives
prompt KV from prefill workers through NIXL, served over the SglangScheduler gRPC API."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.common.config import EngineConfig, WorkerConfig
    from tandem.common.transfer.messages import TransferConfig


def run(args: argparse.Namespace) -> int:
    # Only what every path needs: a --dp-size N controller routes to its replicas and never loads torch.
    from tandem.common.config import (TransferFlags, engine_config_from_args, transfer_config_from_args,
                               worker_config_from_args)
    from tandem.common.flags import from_flags
    from tandem.common.roles import Role
    from tandem.common.rpc.server import worker_info
    from tandem.common.telemetry.tracing import setup_tracing
    from tandem.common.tls import check_readable

    setup_tracing("tandem-decode")
    worker = worker_config_from_args(args)
    config = engine_config_from_args(args).check_role("decode")
    if config.node_rank > 0:  # another node's share of the tensor-parallel ranks: their KV agents open on KV_SETUP
        from tandem.common.model.parallel.runner import run_node_ranks

        return run_node_ranks(config)
    transfer = transfer_config_from_args(args)
    check_readable(transfer.tls)
    if config.dp_size > 1:  # N replicas behind a controller, each its own KV pool and NIXL agent
        from tandem.common.dp.serve import DPRole, run_data_parallel

        role = DPRole(Role.DECODE, from_flags(TransferFlags, args), transfer.engine_id)
        return run_data_parallel(config, worker, transfer.tls, worker_info(args, Role.DECODE).server_args, role)
    return _serve(args, config, worker, transfer)


def _serve(args: argparse.Namespace, config: "EngineConfig", worker: "WorkerConfig",
           transfer: "TransferConfig") -> int:
    """One decode engine (all its TP/PP ranks) served on the worker's port."""
    from tandem.common.config import TransferFlags
    from tandem.common.engine import Engine
    from tandem.common.flags import from_flags
    from tandem.common.roles import Role
    from tandem.common.rpc.server import serve_engine, worker_info
    from tandem.common.scheduler.parts import SchedulerParts
    from tandem.common.telemetry.metrics import WorkerMetrics
    from tandem.common.transfer.kv_manager import DecodeKVManager, KVShard
    from tandem.common.transfer.messages import KVLayout
    from tandem.services.decode.allow_list import BootstrapAllowList
    from tandem.services.decode.scheduler import DecodeScheduler
    from tandem.services.decode.servicer import DecodeServicer

    allowed = from_flags(TransferFlags, args).allowed_bootstrap
    metrics = WorkerMetrics(Role.DECODE)

    def decode_scheduler(parts: SchedulerParts) -> DecodeScheduler:
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
    from tandem.common.config import add_transfer_args, add_worker_args

    p = subparsers.add_parser("decode", help="serve decode legs; receive prompt KV from prefill workers via NIXL")
    add_worker_args(p)
    add_transfer_args(p)
    p.set_defaults(func=run)
