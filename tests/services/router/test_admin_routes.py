"""The control routes' guard and validation, in process: off (404) without --admin-api-key; 401 for a missing,
wrong or client key; 400 naming the field for a bad body; 503 when no worker is registered."""

from __future__ import annotations

import asyncio
import json as jsonlib

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tandem.services.router.config import RouterConfig
from tandem.services.router.gateway import Gateway
from tandem.services.router.http_api import build_app
from tandem.services.router.workers import WorkerEndpoint


def call(config: RouterConfig, method: str, path: str, headers: dict | None = None, json=None) -> tuple[int, dict]:
    async def run():
        async with TestClient(TestServer(build_app(Gateway(config)))) as client:
            resp = await client.request(method, path, headers=headers or {}, json=json)
            text = await resp.text()
            return resp.status, json_or_text(text)
    return asyncio.run(run())


def json_or_text(text: str):
    try:
        return jsonlib.loads(text)
    except ValueError:
        return text


def config(**kw) -> RouterConfig:
    return RouterConfig(workers=[WorkerEndpoint("unified", "127.0.0.1", 1)], **kw)


ADMIN = {"Authorization": "Bearer admin-secret"}


def test_control_routes_are_off_without_an_admin_key():
    for path in ("/update_weights_from_disk", "/pause_generation", "/v1/load_lora_adapter",
                 "/start_expert_distribution_record"):
        status, _ = call(config(), "POST", path, ADMIN, {})
        assert status == 404, path
    assert call(config(), "GET", "/dump_expert_distribution_record", ADMIN)[0] == 404


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer client"}])
def test_control_routes_need_the_admin_key(headers):
    cfg = config(admin_api_key="admin-secret", api_key="client")
    for path in ("/update_weights_from_disk", "/release_memory_occupation", "/v1/unload_lora_adapter"):
        status, body = call(cfg, "POST", path, headers, {"model_path": "/x"})
        assert status == 401, (path, body)
        assert "admin key" in body["error"]["message"]
    status, body = call(cfg, "GET", "/dump_expert_distribution_record", headers)  # SGLang's GET form too
    assert status == 401 and "admin key" in body["error"]["message"], body


def test_only_the_recorder_routes_take_get():
    cfg = config(admin_api_key="admin-secret")
    assert call(cfg, "GET", "/start_expert_distribution_record", ADMIN)[0] == 503  # no worker registered
    assert call(cfg, "GET", "/update_weights_from_disk", ADMIN)[0] == 405


@pytest.mark.parametrize("path, body, field", [
    ("/update_weights_from_disk", {}, "model_path"),
    ("/update_weights_from_disk", {"model_path": 3}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "/x", "flush_cache": False}, "flush_cache"),
    ("/update_weights_from_disk", {"model_path": "/x", "load_format": "pt"}, "load_format"),
    ("/update_weights_from_tensor", {"named_tensors": "not base64!"}, "named_tensors"),
    ("/update_weights_from_distributed", {"names": ["a"], "shapes": [[-1]]}, "shapes"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "group_name": "g",
                                    "world_size": 0}, "world_size"),
    ("/release_memory_occupation", {"tags": "kv_cache"}, "tags"),
    ("/slow_down", {"forward_sleep_time": "long"}, "forward_sleep_time"),
    ("/v1/load_lora_adapter", {"lora_name": "a"}, "lora_path"),
    ("/start_expert_distribution_record", {"mode": "stat"}, "mode"),
])
def test_bad_bodies_name_the_field(path, body, field):
    status, out = call(config(admin_api_key="admin-secret"), "POST", path, ADMIN, body)
    assert status == 400, out
    assert out["error"]["message"].startswith(f"{field}:"), out


def test_admin_key_must_differ_from_the_client_key():
    with pytest.raises(ValueError, match="must differ"):
        RouterConfig(workers=[WorkerEndpoint("unified", "127.0.0.1", 1)], api_key="k", admin_api_key="k").validate()


def test_get_model_info_is_public():
    status, body = call(config(admin_api_key="admin-secret"), "GET", "/get_model_info")
    assert status == 200
    assert body["worker_weight_versions"] == {} and body["weight_version"] is None  # the registry is not started


def test_no_worker_is_503():
    status, body = call(config(admin_api_key="admin-secret"), "POST", "/continue_generation", ADMIN, {})
    assert status == 503
    assert body == {"success": False, "message": "no workers are registered", "workers": []}
