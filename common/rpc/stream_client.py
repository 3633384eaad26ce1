"""The caller's end of GenerateStream.Multiplex (the router's to each worker, a DP controller's to each replica):
one stream per worker that carries every request sent there, and a scheduler step's tokens for all of them in one
message (proto/tandem/generate_stream.proto).

A request started here gets exactly what its own Generate call would have given: each GenerateResponse, then how
it ended (status code, details, trailing metadata), handed to the `deliver` callback it was started with. The
stream opens on first use and again after it breaks; when it breaks, every request on it ends with the error.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional, Union

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tandem.common.proto_gen.tandem import generate_stream_pb2 as spb
from tandem.common.proto_gen.tandem import generate_stream_pb2_grpc as spb_grpc

logger = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}


@dataclass
class Ended:
    """How a request's Generate stream ended: OK, or the status its call would have raised."""

    code: grpc.StatusCode
    details: str = ""
    trailing: dict[str, str] = field(default_factory=dict)


Delivery = Callable[[Union[pb.GenerateResponse, Ended]], None]


class _Call:
    """One open Multiplex call: the requests on it (tag → delivery) and the messages waiting to be written."""

    def __init__(self, stub: spb_grpc.GenerateStreamStub, address: str):
        self.outgoing: asyncio.Queue = asyncio.Queue()
        self.routes: dict[int, Delivery] = {}
        self.open = True
        self.call = stub.Multiplex(self._requests())
        self.reader = asyncio.get_running_loop().create_task(self._read(address))

    async def _requests(self) -> AsyncIterator[spb.StreamRequest]:
        while (message := await self.outgoing.get()) is not None:
            yield message

    async def _read(self, address: str) -> None:
        ended = Ended(grpc.StatusCode.UNAVAILABLE, "the worker ended the request stream")
        try:
            async for batch in self.call:
                for item in batch.items:
                    deliver = self.routes.get(item.tag)
                    if deliver is None:
                        continue  # cancelled here already
                    if item.HasField("end"):
                        del self.routes[item.tag]
                        end = item.end
                        deliver(Ended(_CODES.get(end.code, grpc.StatusCode.UNKNOWN), end.details,
                                      dict(end.trailing_metadata)))
                    else:
                        deliver(pb.GenerateResponse.FromString(item.response))
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details() or ""
            if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
                # What gRPC's core reports when the worker's end of the connection went away mid-stream (a killed
                # process resets it): for each request on the stream, its worker became unavailable.
                code, details = grpc.StatusCode.UNAVAILABLE, f"the request stream broke ({code.name}: {details})"
            ended = Ended(code, details, dict(e.trailing_metadata() or ()))
        except asyncio.CancelledError:
            ended = Ended(grpc.StatusCode.CANCELLED, "the router is closing")
            raise
        finally:
            self.open = False
            routes, self.routes = self.routes, {}
            if routes:
                logger.warning("request stream to %s ended (%s: %s); failing its %d request(s)", address,
                               ended.code.name, ended.details, len(routes))
            for deliver in routes.values():
                deliver(ended)

    def close(self) -> None:
        self.outgoing.put_nowait(None)  # half-close: the worker cancels whatever is still on the stream
        self.call.cancel()


class RequestHandle:
    """One request on a worker's stream; `cancel()` stops it there (the worker frees its KV) and drops what comes."""

    def __init__(self, call: _Call, tag: int):
        self._call, self.tag = call, tag
        self._timer: Optional[asyncio.TimerHandle] = None

    def expire_after(self, timeout: float, deliver: Delivery) -> None:
        """After `timeout` seconds, unless it ended: cancel it on the worker and end it DEADLINE_EXCEEDED."""
        self._timer = asyncio.get_running_loop().call_later(timeout, self._expire, deliver)

    def _expire(self, deliver: Delivery) -> None:
        if self.tag in self._call.routes:
            self.cancel()
            deliver(Ended(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._call.routes.pop(self.tag, None) is not None and self._call.open:
            self._call.outgoing.put_nowait(spb.StreamRequest(cancel=spb.Cancel(tag=self.tag)))


class WorkerStream:
    """The Multiplex stream to one worker, opened on first use and reopened after it breaks."""

    def __init__(self, channel: grpc.aio.Channel, address: str):
        self._stub = spb_grpc.GenerateStreamStub(channel)
        self._address = address
        self._call: Optional[_Call] = None
        self._tags = itertools.count(1)

    def start(self, request: pb.GenerateRequest, deliver: Delivery, timeout: Optional[float] = None,
              metadata: Optional[list[tuple[str, str]]] = None) -> RequestHandle:
        """Send `request`; its responses and its ending reach `deliver`. After `timeout` seconds (if given) it ends
        DEADLINE_EXCEEDED (and is cancelled on the worker), as a Generate call with that timeout would."""
        call = self._call
        if call is None or not call.open:
            call = self._call = _Call(self._stub, self._address)
        tag = next(self._tags)
        call.routes[tag] = deliver
        call.outgoing.put_nowait(spb.StreamRequest(start=spb.Start(
            tag=tag, request=request.SerializeToString(), metadata=dict(metadata or ()))))
        handle = RequestHandle(call, tag)
        if timeout is not None:
            handle.expire_after(timeout, deliver)
        return handle

    def close(self) -> None:
        if self._call is not None and self._call.open:
            self._call.close()
