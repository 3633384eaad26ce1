"""What the prefill and decode workers share: their servicer's request check and their start-up."""

from __future__ import annotations

import argparse
import logging

from common.config import engine_config_from_args
from common.errors import InvalidRequestError
from common.rpc.servicer import SchedulerServicer
from common.rpc.unified_worker import serve_engine, worker_info
from common.telemetry.tracing import ATTR_PREFILL_WORKER, setup_tracing
from common.transfer.worker_args import transfer_config_from_args

logger = logging.getLogger(__name__)


class DisaggregatedServicer(SchedulerServicer):
    """SglangScheduler for one leg of a prefill/decode pair: every request must carry its pairing."""

    def check_role(self, request) -> None:
        role = self.info.role
        if not request.HasField("disaggregated_params"):
            raise InvalidRequestError(
                f"disaggregated_params: this is a {role} worker; send each request to a prefill and a decode "
                "worker with the same bootstrap_room (and bootstrap_host/port naming the prefill)",
                "disaggregated_params")
        dp = request.disaggregated_params
        if dp.bootstrap_room < 0:
            raise InvalidRequestError("disaggregated_params.bootstrap_room must be >= 0", "bootstrap_room")
        if role == "decode" and (not dp.bootstrap_host or dp.bootstrap_port <= 0):
            raise InvalidRequestError(
                "disaggregated_params: bootstrap_host and bootstrap_port must name the prefill's bootstrap server",
                "bootstrap_host")
        if request.sampling_params.n > 1:
            raise InvalidRequestError(
                "sampling_params.n > 1 is not supported on a prefill/decode pair; send n requests with their own "
                "rooms (the Tandem router does this)", "n")

    def trace_attributes(self, req) -> dict:
        if self.info.role == "decode":
            return {ATTR_PREFILL_WORKER: f"{req.bootstrap_host}:{req.bootstrap_port}"}
        return {}


def run_disaggregated_worker(args: argparse.Namespace, role: str, scheduler_cls, bootstrap_port: int = 0) -> int:
    """Load the engine with the role's scheduler (which owns the KV manager) and serve until signalled."""
    from common.engine import Engine

    setup_tracing(f"tandem-{role}")
    config = engine_config_from_args(args)
    transfer = transfer_config_from_args(args, bootstrap_port)
    engine = Engine(config, enable_kv_events=True,
                    scheduler_factory=lambda eng: scheduler_cls(eng, transfer))
    info = worker_info(args, role)
    if role == "prefill":
        info.server_args["disaggregation_bootstrap_port"] = engine.scheduler.bootstrap_port
        logger.info("prefill bootstrap server on %s:%d", args.host, engine.scheduler.bootstrap_port)
    return serve_engine(engine, DisaggregatedServicer, info, args)
