"""Workers added and removed at run time, for a planner or an operator (SGLang's /add_worker and
/remove_worker, as one resource): `GET /workers` lists them, `POST /workers` adds one, `DELETE /workers`
drains one and removes it. Behind --admin-api-key like the other control routes."""

from __future__ import annotations

import logging

from aiohttp import web

from tandem.common.roles import Role
from tandem.services.router.config import WorkerEndpoint, parse_worker_url
from tandem.services.router.errors import ApiError, bad_request

logger = logging.getLogger(__name__)
WORKERS_PATH = "/workers"
DEFAULT_DRAIN_TIMEOUT_S = 300.0
ROLES = {"prefill": "prefill", "decode": "decode", "unified": "worker"}  # role -> parse_worker_url's flag


def endpoint_of(body: dict) -> WorkerEndpoint:
    """The worker a body names: {"url": "grpc://HOST:PORT", "role": "prefill"|"decode"|"unified",
    "bootstrap_port": N (prefill only)}."""
    url, role, boot = body.get("url"), body.get("role"), body.get("bootstrap_port")
    if not isinstance(url, str) or not url:
        raise bad_request("url", "is required: the worker's grpc://HOST:PORT")
    if role not in ROLES:
        raise bad_request("role", f"must be one of {', '.join(ROLES)}, got {role!r}")
    if boot is not None and (isinstance(boot, bool) or not isinstance(boot, int) or not 0 < boot < 65536):
        raise bad_request("bootstrap_port", f"must be a port number, got {boot!r}")
    if role == "prefill" and boot is None:
        raise bad_request("bootstrap_port", "is required for a prefill worker (its KV bootstrap port)")
    if role != "prefill" and boot is not None:
        raise bad_request("bootstrap_port", f"is a prefill worker's; a {role} worker has none")
    try:
        return parse_worker_url(url if boot is None else f"{url},{boot}", ROLES[role])
    except ValueError as e:
        raise bad_request("url", str(e)) from None


def _known(body: dict, fields: set[str]) -> None:
    unknown = sorted(set(body) - fields)
    if unknown:
        raise bad_request(unknown[0], f"is not a field of this route (fields: {', '.join(sorted(fields))})")


class MembershipHandlers:
    def __init__(self, gateway, read_body):
        self.registry = gateway.registry
        self.read_body = read_body  # the admin routes' guard and JSON parsing

    async def list(self, request: web.Request) -> web.Response:
        await self.read_body(request)
        return web.json_response({"workers": self.registry.snapshot()})

    async def add(self, request: web.Request) -> web.Response:
        body = await self.read_body(request)
        _known(body, {"url", "role", "bootstrap_port"})
        endpoint = endpoint_of(body)
        same_address = [e for e in self.registry.workers if e.address == endpoint.address]
        if same_address and same_address[0] != endpoint:
            raise ApiError(409, f"{endpoint.address} is already registered as {same_address[0]}", param="url")
        created = endpoint not in self.registry.workers
        worker = self.registry.add(endpoint)
        if created:
            await self.registry.check_health(worker)  # routable now when it is up, not at the next check
        logger.info("admin: %s worker %s", "added" if created else "kept", endpoint)
        return web.json_response({"success": True, "created": created, "address": endpoint.address,
                                  "role": str(endpoint.role), "healthy": worker.healthy},
                                 status=201 if created else 200)

    async def remove(self, request: web.Request) -> web.Response:
        """Drain, then remove: the answer comes once the worker's requests finished (or the timeout cut them)."""
        body = await self.read_body(request)
        _known(body, {"url", "timeout_s"})
        url = body.get("url")
        if not isinstance(url, str) or not url:
            raise bad_request("url", "is required: the worker's grpc://HOST:PORT")
        timeout = body.get("timeout_s", DEFAULT_DRAIN_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise bad_request("timeout_s", f"must be a number >= 0, got {timeout!r}")
        address = url.split("://", 1)[-1].split(",", 1)[0].rstrip("/")
        matches = [e for e in self.registry.workers if e.address == address]
        if not matches:
            raise ApiError(404, f"url: no worker {address} is registered", param="url")
        endpoint = matches[0]
        if endpoint.role is not Role.UNIFIED and len(self.registry.by_role(endpoint.role, False)) == 1:
            logger.warning("admin: removing the last %s worker %s", endpoint.role, endpoint)
        in_flight = self.registry.workers[endpoint].in_flight
        left = await self.registry.drain(endpoint, float(timeout))
        return web.json_response({"success": left == 0, "address": address, "role": str(endpoint.role),
                                  "drained_requests": in_flight - left, "cut_off_requests": left})


def register(app: web.Application, gateway, read_body) -> None:
    handlers = MembershipHandlers(gateway, read_body)
    app.router.add_get(WORKERS_PATH, handlers.list, allow_head=False)
    app.router.add_post(WORKERS_PATH, handlers.add)
    app.router.add_delete(WORKERS_PATH, handlers.remove)
