"""The decode worker's SglangScheduler servicer: a paired leg names the prefill's bootstrap server, which its spans
record; a plain request (no disaggregated_params) is prefilled here, which GetServerInfo advertises
(`local_prefill: true` in scheduler_info) so that a router sends it plain requests only if it says so."""

from __future__ import annotations

from typing import Optional

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tandem.common.errors import InvalidRequestError
from tandem.common.roles import Role
from tandem.common.rpc.admin import DEFAULT_PROFILE_DIR
from tandem.common.rpc.servicer import SchedulerServicer, require_pairing
from tandem.common.scheduler.io_struct import GenerateRequest
from tandem.common.telemetry.tracing import ATTR_PREFILL_MODE, ATTR_PREFILL_WORKER
from tandem.services.decode.allow_list import BootstrapAllowList


class DecodeServicer(SchedulerServicer):
    """`allowed_bootstrap` (--allowed-bootstrap): when set, a request naming any other bootstrap server is refused
    here, before the decode connects anywhere."""

    def __init__(self, engine, info, metrics, profile_dir: str = DEFAULT_PROFILE_DIR,
                 allowed_bootstrap: Optional[BootstrapAllowList] = None):
        super().__init__(engine, info, metrics, profile_dir=profile_dir)
        self.allowed_bootstrap = allowed_bootstrap

    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Embed: a decode worker only continues generation legs; "
                            "send embeddings to a unified or prefill worker")

    def check_role(self, request: pb.GenerateRequest) -> None:
        if not request.HasField("disaggregated_params"):
            return  # prefilled locally, as on a unified worker
        require_pairing(request, Role.DECODE)
        dp = request.disaggregated_params
        if not dp.bootstrap_host or dp.bootstrap_port <= 0:
            raise InvalidRequestError(
                "disaggregated_params: bootstrap_host and bootstrap_port must name the prefill's bootstrap server",
                "bootstrap_host")
        allowed = self.allowed_bootstrap
        if allowed is not None and not allowed.allows(dp.bootstrap_host, dp.bootstrap_port):
            raise InvalidRequestError(
                f"disaggregated_params: bootstrap server {dp.bootstrap_host}:{dp.bootstrap_port} is not in this "
                f"decode's --allowed-bootstrap ({allowed})", "bootstrap_host")

    def trace_attributes(self, req: GenerateRequest) -> dict:
        if req.bootstrap_room is None:
            return {ATTR_PREFILL_MODE: "local"}
        return {ATTR_PREFILL_MODE: "remote", ATTR_PREFILL_WORKER: f"{req.bootstrap_host}:{req.bootstrap_port}"}

    async def GetServerInfo(self, request, context) -> pb.GetServerInfoResponse:
        info = await super().GetServerInfo(request, context)
        info.scheduler_info.update({"local_prefill": True})
        return info
