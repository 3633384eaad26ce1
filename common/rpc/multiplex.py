"""GenerateStream.Multiplex on a worker: many Generate calls on one stream, a step's outputs in one message.

Each request on the stream runs the worker's own `Generate` (so validation, status codes, trailing metadata and
the abort-on-early-end that frees its KV are the per-request call's, unchanged) in a task of its own, with a call
context that turns `context.abort` into an End item. The sender writes whatever every task produced since its last
write as one StreamResponse: the engine hands a step's outputs to the event loop in one callback, every request's
task runs in that loop turn, and the sender runs after them.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import AsyncIterator, Callable

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tandem.common.proto_gen.tandem import generate_stream_pb2 as spb
from tandem.common.proto_gen.tandem import generate_stream_pb2_grpc as spb_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = spb.DESCRIPTOR.services_by_name["GenerateStream"].full_name
GenerateFn = Callable[[pb.GenerateRequest, object], AsyncIterator[pb.GenerateResponse]]


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple):
        super().__init__(details)
        self.code, self.details, self.trailing = code, details, trailing


class StreamedCallContext:
    """The part of grpc.aio's ServicerContext a Generate implementation uses, for one request on the stream."""

    def __init__(self, metadata: dict[str, str]):
        self._metadata = tuple(metadata.items())
        self.trailing: tuple = ()

    def invocation_metadata(self) -> tuple:
        return self._metadata

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = tuple(metadata)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        raise _Aborted(code, details, tuple(trailing_metadata) or self.trailing)


def _end(tag: int, code: grpc.StatusCode, details: str, trailing: tuple) -> spb.Item:
    return spb.Item(tag=tag, end=spb.End(code=code.value[0], details=details,
                                         trailing_metadata={k: str(v) for k, v in trailing}))


class _Stream:
    """One Multiplex call: its requests' tasks and the items they produced, not yet written."""

    def __init__(self, generate: GenerateFn):
        self.generate = generate
        self.tasks: dict[int, asyncio.Task] = {}
        self.outbox: list[spb.Item] = []
        self.ready = asyncio.Event()
        self.reading = True

    def push(self, item: spb.Item) -> None:
        self.outbox.append(item)
        self.ready.set()

    async def run(self, tag: int, start: spb.Start) -> None:
        context = StreamedCallContext(dict(start.metadata))
        try:
            request = pb.GenerateRequest.FromString(start.request)
        except Exception as e:  # noqa: BLE001 - a malformed payload is the caller's error, named as such
            self.push(_end(tag, grpc.StatusCode.INVALID_ARGUMENT, f"start.request: not a GenerateRequest ({e})", ()))
            return
        try:
            async with aclosing(self.generate(request, context)) as responses:
                async for response in responses:
                    self.push(spb.Item(tag=tag, response=response.SerializeToString()))
            self.push(_end(tag, grpc.StatusCode.OK, "", context.trailing))
        except _Aborted as e:
            self.push(_end(tag, e.code, e.details, e.trailing))
        except asyncio.CancelledError:
            raise  # a Cancel or the stream's end: Generate's own clean-up aborted it in the engine
        except Exception as e:  # noqa: BLE001 - what grpc.aio would report as UNKNOWN for a Generate call
            logger.exception("request %s on a Multiplex stream failed", request.request_id)
            self.push(_end(tag, grpc.StatusCode.UNKNOWN, f"{type(e).__name__}: {e}", ()))
        finally:
            self.tasks.pop(tag, None)
            self.ready.set()

    async def read(self, requests: AsyncIterator[spb.StreamRequest]) -> None:
        try:
            async for message in requests:
                kind = message.WhichOneof("kind")
                if kind == "start":
                    tag = message.start.tag
                    if tag in self.tasks:
                        self.push(_end(tag, grpc.StatusCode.INVALID_ARGUMENT,
                                       f"start.tag: {tag} is in flight on this stream already", ()))
                        continue
                    self.tasks[tag] = asyncio.ensure_future(self.run(tag, message.start))
                elif kind == "cancel" and (task := self.tasks.get(message.cancel.tag)) is not None:
                    task.cancel()
        finally:
            self.reading = False
            self.ready.set()

    def cancel_all(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()


class GenerateStreamServicer(spb_grpc.GenerateStreamServicer):
    """Serves Multiplex over `generate`: a servicer's Generate method (the scheduler's, or a DP controller's)."""

    def __init__(self, generate: GenerateFn):
        self.generate = generate

    async def Multiplex(self, request_iterator, context) -> AsyncIterator[spb.StreamResponse]:
        stream = _Stream(self.generate)
        reader = asyncio.ensure_future(stream.read(request_iterator))
        try:
            while stream.reading or stream.tasks or stream.outbox:
                await stream.ready.wait()
                stream.ready.clear()
                if stream.outbox:
                    items, stream.outbox = stream.outbox, []
                    yield spb.StreamResponse(items=items)
        finally:
            reader.cancel()
            stream.cancel_all()  # the caller went away: every request still on the stream ends, freeing its KV


def add_to_server(generate: GenerateFn, server: grpc.aio.Server) -> None:
    spb_grpc.add_GenerateStreamServicer_to_server(GenerateStreamServicer(generate), server)
