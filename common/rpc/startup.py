"""serve_role: the start-up the unified, prefill and decode workers share — which process this one is (a later
node's tensor-parallel ranks, a data-parallel controller, or one engine) and how it serves."""

from __future__ import annotations

import argparse
import logging
from typing import Callable, Optional

from tandem.common.config import EngineConfig, TlsConfig, WorkerConfig, check_exposure
from tandem.common.dp.serve import DPRole, run_data_parallel
from tandem.common.roles import Role
from tandem.common.rpc.server import worker_info
from tandem.common.tls import check_readable

logger = logging.getLogger(__name__)


def serve_role(args: argparse.Namespace, role: Role, config: EngineConfig, worker: WorkerConfig,
               tls: Optional[TlsConfig], serve: Callable[[], int], dp_role: Optional[DPRole] = None) -> int:
    """A node past the first runs its share of the tensor-parallel ranks (node 0 schedules and serves; a PD
    worker's rank KV agents open on KV_SETUP). A --dp-size N worker is a controller over N replica processes
    on the worker's port, routing only. Otherwise `serve()` builds one engine and serves it. The TLS files are
    read up front, before a worker spends minutes loading its model; so is a plaintext listener beyond loopback
    refused (ConfigError) unless --insecure."""
    warning = check_exposure(worker, tls)
    if warning is not None:
        logger.warning("%s", warning)
    if config.node_rank > 0:
        from tandem.common.model.parallel.runner import run_node_ranks  # torch, which a DP controller never loads

        return run_node_ranks(config)
    check_readable(tls)
    if config.dp_size > 1:
        return run_data_parallel(config, worker, tls, worker_info(args, role).server_args, dp_role or DPRole())
    return serve()
