"""The prefill worker's `tandem.bootstrap.v1.Bootstrap` gRPC server: a thin edge over PrefillSide."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import grpc

from tandem.common.config import TlsConfig
from tandem.common.tls import add_port

from tandem.common.proto_gen.tandem import bootstrap_pb2 as pb
from tandem.common.proto_gen.tandem import bootstrap_pb2_grpc as pb_grpc
from tandem.common.transfer.failures import failure_kind
from tandem.common.transfer.prefill_side import BootstrapRejected, PrefillSide

logger = logging.getLogger(__name__)


class BootstrapServicer(pb_grpc.BootstrapServicer):
    def __init__(self, prefill: PrefillSide):
        self._prefill = prefill

    def RegisterDecode(self, request: pb.RegisterDecodeRequest, context: grpc.ServicerContext) -> pb.RegisterDecodeResponse:
        try:
            return self._prefill.register_decode(request)
        except BootstrapRejected as e:
            logger.warning("rejected decode %s: %s", request.engine_id, e)
            context.abort(e.code, str(e))

    def SendDestination(self, request: pb.SendDestinationRequest, context: grpc.ServicerContext) -> pb.SendDestinationResponse:
        try:
            self._prefill.set_destination(request)
        except BootstrapRejected as e:
            context.abort(e.code, str(e))
        return pb.SendDestinationResponse()

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        known = self._prefill.heartbeat(request.engine_id, request.pending_rooms)
        return pb.HeartbeatResponse(engine_id=self._prefill.config.engine_id, decode_registered=known)

    def AbortRoom(self, request: pb.AbortRoomRequest, context: grpc.ServicerContext) -> pb.AbortRoomResponse:
        self._prefill.abort_from_decode(request.room, request.engine_id, request.reason, failure_kind(request.kind))
        return pb.AbortRoomResponse()


def start_bootstrap_server(prefill: PrefillSide, host: str, port: int, max_workers: int = 8,
                           tls: Optional[TlsConfig] = None) -> tuple[grpc.Server, int]:
    """Start serving; returns the server and the bound port (useful when port is 0). With `tls` on, only a client
    holding a CA-signed certificate (a decode of this deployment) gets past the handshake."""
    server = grpc.server(ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="bootstrap"))
    pb_grpc.add_BootstrapServicer_to_server(BootstrapServicer(prefill), server)
    bound = add_port(server, f"{host}:{port}", tls)
    if bound == 0:
        raise OSError(f"cannot bind the bootstrap server to {host}:{port}")
    server.start()
    logger.info("bootstrap server listening on %s:%d (%s)", host, bound,
                "mutual TLS" if tls is not None and tls.enabled else "plaintext")
    return server, bound
