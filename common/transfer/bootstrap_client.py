"""Decode-side client of a prefill's Bootstrap service; gRPC errors become BootstrapError."""

from __future__ import annotations

from typing import Optional

import grpc

from tandem.common.config import TlsConfig
from tandem.common.tls import blocking_channel
from tandem.common.proto_gen.tandem import bootstrap_pb2 as pb
from tandem.common.proto_gen.tandem import bootstrap_pb2_grpc as pb_grpc


class BootstrapError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class BootstrapClient:
    """One channel to one prefill bootstrap endpoint; every call is unary with a deadline. With `tls` on, the
    channel completes its handshake only with a server whose certificate the CA signed, so the decode's NIXL
    metadata and pool addresses never reach anyone else."""

    def __init__(self, host: str, port: int, timeout_s: float, tls: Optional[TlsConfig] = None):
        self.address = f"{host}:{port}"
        self._timeout_s = timeout_s
        self._channel = blocking_channel(self.address, tls)
        self._stub = pb_grpc.BootstrapStub(self._channel)

    def _call(self, method, request, timeout_s: float | None = None):
        try:
            return method(request, timeout=timeout_s or self._timeout_s)
        except grpc.RpcError as e:
            raise BootstrapError(e.code(), f"{self.address}: {e.details() or e.code().name}") from None

    def register(self, engine_id: str, agent_name: str, agent_metadata: bytes, layout: pb.KVLayout,
                 weight_version: str = "", total_kv_heads: int = 0,
                 ranks: list[pb.RankPool] = ()) -> pb.RegisterDecodeResponse:
        req = pb.RegisterDecodeRequest(engine_id=engine_id, agent_name=agent_name, agent_metadata=agent_metadata,
                                       layout=layout, weight_version=weight_version, total_kv_heads=total_kv_heads,
                                       ranks=ranks)
        return self._call(self._stub.RegisterDecode, req)

    def send_destination(self, room: int, engine_id: str, dst_pages, prefix_tokens: int, request_id: str,
                         weight_version: str = "") -> None:
        req = pb.SendDestinationRequest(room=room, engine_id=engine_id, dst_page_indices=[int(p) for p in dst_pages],
                                        prefix_tokens=prefix_tokens, request_id=request_id,
                                        weight_version=weight_version)
        self._call(self._stub.SendDestination, req)

    def heartbeat(self, engine_id: str, timeout_s: float, pending_rooms: list[int] = ()) -> pb.HeartbeatResponse:
        request = pb.HeartbeatRequest(engine_id=engine_id, pending_rooms=pending_rooms)
        return self._call(self._stub.Heartbeat, request, timeout_s)

    def abort_room(self, room: int, engine_id: str, reason: str, kind: str = "") -> None:
        self._call(self._stub.AbortRoom, pb.AbortRoomRequest(room=room, engine_id=engine_id, reason=reason, kind=kind))

    def close(self) -> None:
        self._channel.close()
