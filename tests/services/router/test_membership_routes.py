"""Workers added and removed at run time (GET/POST/DELETE /workers), in process: the admin key guards them, a
bad body is a 400 naming the field, and removal drains: the worker gets no new request at once and the answer
waits for the requests in flight."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tandem.common.roles import Role
from tandem.services.router.config import RouterConfig
from tandem.services.router.gateway import Gateway
from tandem.services.router.http_api import build_app
from tandem.services.router.workers import WorkerEndpoint

ADMIN = {"Authorization": "Bearer admin-secret"}
DECODE = WorkerEndpoint(Role.DECODE, "127.0.0.1", 1)


def config(**kw) -> RouterConfig:
    return RouterConfig(prefill=[WorkerEndpoint(Role.PREFILL, "127.0.0.1", 2, 3)], decode=[DECODE], **kw)


async def with_client(cfg: RouterConfig, body):
    gateway = Gateway(cfg)
    async with TestClient(TestServer(build_app(gateway))) as client:
        return await body(client, gateway)


def test_the_routes_are_off_without_an_admin_key():
    async def body(client, gateway):
        return [(await client.request(m, "/workers", headers=ADMIN, json={})).status for m in ("GET", "POST",
                                                                                            "DELETE")]
    assert asyncio.run(with_client(config(), body)) == [404, 404, 404]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer client"}])
def test_the_routes_need_the_admin_key(headers):
    async def body(client, gateway):
        statuses = [(await client.request(m, "/workers", headers=headers,
                                          json={"url": "grpc://127.0.0.1:9", "role": "decode"})).status
                    for m in ("GET", "POST", "DELETE")]
        return statuses, len(gateway.registry.workers)
    assert asyncio.run(with_client(config(admin_api_key="admin-secret", api_key="client"), body)) == ([401] * 3, 0)


@pytest.mark.parametrize("method, json, field", [
    ("POST", {}, "url"),
    ("POST", {"url": "grpc://127.0.0.1:9"}, "role"),
    ("POST", {"url": "grpc://127.0.0.1:9", "role": "router"}, "role"),
    ("POST", {"url": "grpc://127.0.0.1:9", "role": "prefill"}, "bootstrap_port"),
    ("POST", {"url": "grpc://127.0.0.1:9", "role": "decode", "bootstrap_port": 5}, "bootstrap_port"),
    ("POST", {"url": "grpc://127.0.0.1:9", "role": "prefill", "bootstrap_port": "5"}, "bootstrap_port"),
    ("POST", {"url": "http://127.0.0.1:9", "role": "decode"}, "url"),
    ("POST", {"url": "grpc://127.0.0.1:9", "role": "decode", "weight": 2}, "weight"),
    ("DELETE", {}, "url"),
    ("DELETE", {"url": "grpc://127.0.0.1:1", "timeout_s": -1}, "timeout_s"),
    ("DELETE", {"url": "grpc://127.0.0.1:1", "timeout_s": "soon"}, "timeout_s"),
])
def test_bad_bodies_name_the_field(method, json, field):
    async def body(client, gateway):
        resp = await client.request(method, "/workers", headers=ADMIN, json=json)
        return resp.status, (await resp.json())["error"], len(gateway.registry.workers)
    status, error, registered = asyncio.run(with_client(config(admin_api_key="admin-secret"), body))
    assert status == 400 and error["param"] == field and error["message"].startswith(field), error
    assert registered == 0  # the gateway never started: nothing was added either


def test_add_then_list_then_refuse_a_second_role_for_one_address():
    async def body(client, gateway):
        added = await client.post("/workers", headers=ADMIN, json={"url": "grpc://127.0.0.1:9", "role": "decode"})
        again = await client.post("/workers", headers=ADMIN, json={"url": "127.0.0.1:9", "role": "decode"})
        clash = await client.post("/workers", headers=ADMIN, json={"url": "grpc://127.0.0.1:9", "role": "prefill",
                                                                   "bootstrap_port": 10})
        listed = await (await client.get("/workers", headers=ADMIN)).json()
        result = (added.status, await added.json(), again.status, clash.status, listed["workers"])
        await gateway.registry.stop()
        return result
    status, added, again, clash, listed = asyncio.run(with_client(config(admin_api_key="admin-secret"), body))
    assert status == 201 and added["created"] and added["role"] == "decode" and not added["healthy"]  # nobody there
    assert again == 200 and clash == 409
    assert [(w["address"], w["role"], w["draining"]) for w in listed] == [("127.0.0.1:9", "decode", False)]


def test_removal_drains_the_requests_in_flight_first():
    """The worker leaves the routable set at once; the answer waits until its last request ends."""
    async def body(client, gateway):
        registry = gateway.registry
        worker = registry.add(DECODE)
        worker.healthy, worker.in_flight = True, 2
        assert registry.by_role(Role.DECODE) == [worker]
        removal = asyncio.ensure_future(client.delete("/workers", headers=ADMIN,
                                                      json={"url": "grpc://127.0.0.1:1"}))
        while not worker.draining:
            await asyncio.sleep(0.01)
        routable_while_draining = registry.by_role(Role.DECODE)
        worker.in_flight = 1
        await asyncio.sleep(0.2)
        still_waiting = not removal.done() and DECODE in registry.workers
        worker.in_flight = 0
        resp = await removal
        return routable_while_draining, still_waiting, resp.status, await resp.json(), DECODE in registry.workers
    routable, waiting, status, answer, registered = asyncio.run(with_client(config(admin_api_key="admin-secret"),
                                                                            body))
    assert routable == [] and waiting
    assert status == 200 and answer["success"] and answer["drained_requests"] == 2 and not registered
    assert answer["cut_off_requests"] == 0


def test_removal_is_bounded_by_its_timeout():
    async def body(client, gateway):
        worker = gateway.registry.add(DECODE)
        worker.in_flight = 1  # a request that never ends
        resp = await client.delete("/workers", headers=ADMIN, json={"url": "127.0.0.1:1", "timeout_s": 0.1})
        missing = await client.delete("/workers", headers=ADMIN, json={"url": "127.0.0.1:1"})
        return await resp.json(), missing.status, DECODE in gateway.registry.workers
    answer, missing, registered = asyncio.run(with_client(config(admin_api_key="admin-secret"), body))
    assert not answer["success"] and answer["cut_off_requests"] == 1 and not registered
    assert missing == 404
