"""The decode worker's SglangScheduler servicer: every request must be a paired leg that names the prefill's
bootstrap server, which its spans record."""

from __future__ import annotations

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from common.errors import InvalidRequestError
from common.roles import Role
from common.rpc.servicer import SchedulerServicer, require_pairing
from common.scheduler.io_struct import GenerateRequest
from common.telemetry.tracing import ATTR_PREFILL_WORKER


class DecodeServicer(SchedulerServicer):
    def check_role(self, request: pb.GenerateRequest) -> None:
        require_pairing(request, Role.DECODE)
        dp = request.disaggregated_params
        if not dp.bootstrap_host or dp.bootstrap_port <= 0:
            raise InvalidRequestError(
                "disaggregated_params: bootstrap_host and bootstrap_port must name the prefill's bootstrap server",
                "bootstrap_host")

    def trace_attributes(self, req: GenerateRequest) -> dict:
        return {ATTR_PREFILL_WORKER: f"{req.bootstrap_host}:{req.bootstrap_port}"}
