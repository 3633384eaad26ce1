"""The prefill worker's SglangScheduler servicer: what differs from the shared one is that every request must be a
paired leg (its room); the leg's stream ends with the first token once its KV reached the decode."""

from __future__ import annotations

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tandem.common.roles import Role
from tandem.common.rpc.servicer import SchedulerServicer, require_pairing


class PrefillServicer(SchedulerServicer):
    def check_role(self, request: pb.GenerateRequest) -> None:
        require_pairing(request, Role.PREFILL)
