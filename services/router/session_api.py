"""The router's session endpoints (SGLang's): POST /open_session, POST /close_session; and the release of a
closed (or idle) session's KV pins on the workers that served it."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
import orjson
from aiohttp import web

from tandem.common.proto_gen.tandem import admin_pb2 as apb
from tandem.common.proto_gen.tandem import admin_pb2_grpc as apb_grpc
from tandem.services.router.errors import ApiError
from tandem.services.router.gateway import Gateway
from tandem.services.router.sessions import Session, parse_close_session, parse_open_session

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0
MAX_BODY_BYTES = 64 * 1024
_EXPIRY_TASK = web.AppKey("session_expiry", asyncio.Task)


class SessionHandlers:
    def __init__(self, gateway: Gateway, read_body):
        self.gateway = gateway
        self.read_body = read_body

    async def _json(self, request: web.Request):
        raw = await self.read_body(request, MAX_BODY_BYTES)
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None

    async def open_session(self, request: web.Request) -> web.Response:
        """The session's id, as a JSON string (SGLang's answer)."""
        capacity, session_id = parse_open_session(await self._json(request))
        session = self.gateway.sessions.open(capacity, session_id)
        return web.json_response(session.id)

    async def close_session(self, request: web.Request) -> web.Response:
        session = self.gateway.sessions.close(parse_close_session(await self._json(request)))
        await release(self.gateway, session)
        return web.json_response(True)


async def release(gateway: Gateway, session: Session) -> None:
    """Tell every worker that may pin the session's KV to let it go. A worker that is gone, or does not answer,
    has nothing to release (a lost worker's pins went with it; a slow one's expire with --session-timeout-s)."""
    async def close_on(endpoint) -> None:
        worker = gateway.registry.workers.get(endpoint)
        if worker is None:
            return
        try:
            reply = await apb_grpc.WorkerAdminStub(worker.channel).CloseSession(
                apb.CloseSessionRequest(session_id=session.id), timeout=CLOSE_TIMEOUT_S)
            if not reply.success:
                logger.warning("session %s: %s could not release it: %s", session.id, endpoint, reply.message)
        except grpc.aio.AioRpcError as e:
            logger.info("session %s: %s did not answer CloseSession (%s)", session.id, endpoint, e.code().name)

    await asyncio.gather(*(close_on(endpoint) for endpoint in session.workers))


async def expire_idle(gateway: Gateway) -> None:
    """Close sessions idle for longer than --session-timeout-s, checking a few times per timeout."""
    period = min(gateway.sessions.timeout_s / 4, 30.0)
    while True:
        await asyncio.sleep(period)
        for session in gateway.sessions.expire():
            logger.info("session %s: idle for %.0f s; closed", session.id, gateway.sessions.timeout_s)
            await release(gateway, session)


def add_session_routes(app: web.Application, gateway: Gateway, read_body) -> None:
    handlers = SessionHandlers(gateway, read_body)
    app.router.add_post("/open_session", handlers.open_session)
    app.router.add_post("/close_session", handlers.close_session)

    async def start(app: web.Application) -> None:
        app[_EXPIRY_TASK] = asyncio.create_task(expire_idle(gateway), name="session-expiry")

    async def stop(app: web.Application) -> None:
        task = app[_EXPIRY_TASK]
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
