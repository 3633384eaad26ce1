"""Runtime control over HTTP: SGLang's routes and JSON bodies (update_weights_*, *_memory_occupation, pause/continue,
slow_down, the expert-distribution recorder) and vLLM's LoRA routes, each fanned out to every worker with per-worker
results. Guarded by --admin-api-key (Bearer), distinct from the client key: without one configured the routes do not
exist (404)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

import grpc
from aiohttp import web
from prometheus_client import Counter
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tandem.common.control.expert_dumps import merge_dumps
from tandem.common.proto_gen.tandem import admin_pb2 as apb
from tandem.common.proto_gen.tandem import admin_pb2_grpc as apb_grpc
from tandem.services.router import membership_api
from tandem.services.router.errors import ApiError, bad_request
from tandem.services.router.membership_api import WORKERS_PATH
from tandem.services.router.workers import Worker

logger = logging.getLogger(__name__)
GRPC_TIMEOUT_S = 600.0  # an update waits for running requests; a distributed one for the trainer
LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
_STATUS_OF_CODE = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
                   grpc.StatusCode.UNIMPLEMENTED: 501, grpc.StatusCode.UNAVAILABLE: 503,
                   grpc.StatusCode.DEADLINE_EXCEEDED: 504}


@dataclass
class WorkerResult:
    worker: Worker
    success: bool
    message: str
    status: int = 200  # what this worker's answer means as HTTP
    extra: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        return {"address": self.worker.endpoint.address, "role": self.worker.role, "success": self.success,
                "message": self.message, **self.extra}


def _body_field(body: dict, name: str, kind, default=None, required: bool = False):
    value = body.get(name, default)
    if value is None:
        if required:
            raise bad_request(name, "is required")
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise bad_request(name, f"must be {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


def _reject_unknown(body: dict, known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_request(unknown[0], f"is not a field of this route (fields: {', '.join(sorted(known))})")


class AdminHandlers:
    def __init__(self, gateway, admin_key: str):
        self.gateway = gateway
        self.registry = gateway.registry
        self.admin_key = admin_key
        self.calls = Counter("tandem_router_control_calls", "Runtime control calls fanned out, by route and status",
                             ["route", "status"], registry=gateway.metrics.registry)

    # ---- plumbing -------------------------------------------------------------------------------

    def authorized(self, request: web.Request) -> bool:
        return hmac.compare_digest(request.headers.get("Authorization", "").encode(),
                                   f"Bearer {self.admin_key}".encode())

    async def read_body(self, request: web.Request) -> dict:
        """The JSON object a caller with the admin key sent ({} for none); 401 without the key."""
        if not self.authorized(request):
            raise ApiError(401, "invalid or missing admin key (Authorization: Bearer <--admin-api-key>)",
                           code="invalid_api_key")
        raw = await request.read()
        try:
            body = json.loads(raw) if raw.strip() else {}
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    def route(self, name: str, handler: Callable[[dict], Awaitable[tuple[list[WorkerResult], dict]]]):
        async def serve(request: web.Request) -> web.Response:
            started = time.monotonic()
            body = await self.read_body(request)
            results, summary = await handler(body)
            status = max((r.status for r in results), default=503)
            self.calls.labels(name, str(status)).inc()
            logger.info("control %s: %d worker(s), status %d in %.2fs", name, len(results), status,
                        time.monotonic() - started)
            payload = {"success": status == 200 and bool(results), **summary,
                       "message": "; ".join(f"{r.worker.endpoint.address}: {r.message}" for r in results)
                       or "no workers are registered", "workers": [r.as_json() for r in results]}
            return web.json_response(payload, status=status)
        return serve

    def workers(self) -> list[Worker]:
        """Every registered worker, healthy or not: an update must not skip one (its failure is reported)."""
        return sorted(self.registry.workers.values(), key=lambda w: (w.role, w.endpoint.address))

    async def fan_out(self, call: Callable[[Worker], Awaitable[WorkerResult]],
                      workers: Optional[list[Worker]] = None) -> list[WorkerResult]:
        async def one(worker: Worker) -> WorkerResult:
            try:
                return await call(worker)
            except grpc.aio.AioRpcError as e:
                return WorkerResult(worker, False, f"{e.code().name}: {e.details()}",
                                    _STATUS_OF_CODE.get(e.code(), 502))
        return list(await asyncio.gather(*(one(w) for w in (workers if workers is not None else self.workers()))))

    @staticmethod
    def admin(worker: Worker) -> apb_grpc.WorkerAdminStub:
        return apb_grpc.WorkerAdminStub(worker.channel)

    async def control(self, worker: Worker, rpc: str, request, restores: bool = False) -> WorkerResult:
        """`restores`: the call brings the worker back (resume, continue); its breaker closes on success, since
        what failed while it was released or paused says nothing about its health."""
        reply = await getattr(self.admin(worker), rpc)(request, timeout=GRPC_TIMEOUT_S)
        if reply.success and restores:
            worker.breaker.record_success()
        return WorkerResult(worker, reply.success, reply.message, 200 if reply.success else 400)

    async def update(self, worker: Worker, rpc: str, request) -> WorkerResult:
        reply = await getattr(self.admin(worker), rpc)(request, timeout=GRPC_TIMEOUT_S)
        worker.weight_version = reply.weight_version  # pairing follows at once, not at the next health check
        return WorkerResult(worker, reply.success, reply.message, 200 if reply.success else 400,
                            {"weight_version": reply.weight_version,
                             "num_aborted_requests": reply.num_aborted_requests})

    # ---- weights --------------------------------------------------------------------------------

    @staticmethod
    def _update_fields(body: dict) -> dict:
        if body.get("flush_cache") is False:
            raise bad_request("flush_cache", "false is not supported: KV computed with old weights is always "
                                             "flushed after an update")
        out = {"abort_all_requests": _body_field(body, "abort_all_requests", bool, False)}
        version = _body_field(body, "weight_version", str)
        if version is not None:
            out["weight_version"] = version
        return out

    async def update_weights_from_disk(self, body: dict):
        _reject_unknown(body, {"model_path", "abort_all_requests", "weight_version", "flush_cache"})
        request = apb.UpdateWeightsFromDiskRequest(model_path=_body_field(body, "model_path", str, required=True),
                                                   **self._update_fields(body))
        return await self.fan_out(lambda w: self.update(w, "UpdateWeightsFromDisk", request)), {}

    async def update_weights_from_tensor(self, body: dict):
        _reject_unknown(body, {"named_tensors", "abort_all_requests", "weight_version", "flush_cache"})
        encoded = _body_field(body, "named_tensors", str, required=True)
        try:
            data = base64.b64decode(encoded, validate=True)
            # refuse a bad payload here, with a 400, before any worker sees it
            await asyncio.to_thread(_load_safetensors, data)
        except (binascii.Error, ValueError) as e:
            raise bad_request("named_tensors", f"must be base64 of a safetensors file ({e})") from e
        except Exception as e:  # noqa: BLE001 - safetensors' own error type
            raise bad_request("named_tensors", f"is not a safetensors payload ({e})") from e
        request = apb.UpdateWeightsFromTensorRequest(named_tensors=data, **self._update_fields(body))
        return await self.fan_out(lambda w: self.update(w, "UpdateWeightsFromTensor", request)), {}

    async def init_weights_update_group(self, body: dict):
        """Every worker joins the trainer's group; worker i (in address order) is rank rank_offset + i."""
        fields = ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend", "timeout_s")
        _reject_unknown(body, set(fields))
        workers = self.workers()
        offset = _body_field(body, "rank_offset", int, 1)
        world_size = _body_field(body, "world_size", int, required=True)
        if offset < 1 or offset + len(workers) > world_size:
            raise bad_request("world_size", f"{world_size} cannot hold the trainer (rank 0) and {len(workers)} "
                                            f"worker(s) from rank_offset {offset}")
        base = dict(master_address=_body_field(body, "master_address", str, required=True),
                    master_port=_body_field(body, "master_port", int, required=True), world_size=world_size,
                    group_name=_body_field(body, "group_name", str, required=True),
                    backend=_body_field(body, "backend", str, "gloo"))
        timeout = _body_field(body, "timeout_s", float)

        async def join(worker: Worker) -> WorkerResult:
            rank = offset + workers.index(worker)
            request = apb.InitWeightsUpdateGroupRequest(rank_offset=rank, timeout_s=timeout, **base)
            result = await self.control(worker, "InitWeightsUpdateGroup", request)
            result.extra["rank"] = rank
            return result
        return await self.fan_out(join, workers), {}

    async def update_weights_from_distributed(self, body: dict):
        _reject_unknown(body, {"names", "dtypes", "shapes", "group_name", "abort_all_requests", "weight_version",
                               "flush_cache"})
        names, dtypes = _body_field(body, "names", list, required=True), _body_field(body, "dtypes", list, [])
        shapes = _body_field(body, "shapes", list, required=True)
        if not all(isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes):
            raise bad_request("shapes", "must be a list of lists of non-negative integers")
        request = apb.UpdateWeightsFromDistributedRequest(
            names=[str(n) for n in names], dtypes=[str(d) for d in dtypes] or ["float32"] * len(names),
            shapes=[apb.TensorShape(dims=s) for s in shapes],
            group_name=_body_field(body, "group_name", str, "weight_update_group"), **self._update_fields(body))
        return await self.fan_out(lambda w: self.update(w, "UpdateWeightsFromDistributed", request)), {}

    async def destroy_weights_update_group(self, body: dict):
        _reject_unknown(body, {"group_name"})
        request = apb.DestroyWeightsUpdateGroupRequest(group_name=_body_field(body, "group_name", str, required=True))
        return await self.fan_out(lambda w: self.control(w, "DestroyWeightsUpdateGroup", request)), {}

    async def get_weights_by_name(self, body: dict):
        _reject_unknown(body, {"name", "truncate_size"})
        request = apb.GetWeightsByNameRequest(name=_body_field(body, "name", str, required=True),
                                              truncate_size=_body_field(body, "truncate_size", int, 100))

        async def get(worker: Worker) -> WorkerResult:
            reply = await self.admin(worker).GetWeightsByName(request, timeout=GRPC_TIMEOUT_S)
            if not reply.success:
                return WorkerResult(worker, False, reply.message, 400)
            tensor = (await asyncio.to_thread(_load_safetensors, reply.tensor))[request.name]
            return WorkerResult(worker, True, "ok", 200, {"weights": tensor.tolist()})
        return await self.fan_out(get), {}

    # ---- memory and generation ------------------------------------------------------------------

    async def release_memory_occupation(self, body: dict):
        _reject_unknown(body, {"tags"})
        request = apb.MemoryOccupationRequest(tags=self._tags(body))
        return await self.fan_out(lambda w: self.control(w, "ReleaseMemoryOccupation", request)), {}

    async def resume_memory_occupation(self, body: dict):
        _reject_unknown(body, {"tags"})
        request = apb.MemoryOccupationRequest(tags=self._tags(body))
        return await self.fan_out(lambda w: self.control(w, "ResumeMemoryOccupation", request, restores=True)), {}

    @staticmethod
    def _tags(body: dict) -> list[str]:
        tags = _body_field(body, "tags", list, [])
        if not all(isinstance(t, str) for t in tags):
            raise bad_request("tags", "must be a list of strings (kv_cache, weights)")
        return tags

    async def pause_generation(self, body: dict):
        _reject_unknown(body, {"mode"})
        request = apb.PauseGenerationRequest(mode=_body_field(body, "mode", str, "abort"))
        return await self.fan_out(lambda w: self.control(w, "PauseGeneration", request)), {}

    async def continue_generation(self, body: dict):
        _reject_unknown(body, set())
        request = apb.ContinueGenerationRequest()
        return await self.fan_out(lambda w: self.control(w, "ContinueGeneration", request, restores=True)), {}

    async def slow_down(self, body: dict):
        _reject_unknown(body, {"forward_sleep_time"})
        sleep = _body_field(body, "forward_sleep_time", float)
        request = apb.SlowDownRequest(forward_sleep_time=sleep) if sleep is not None else apb.SlowDownRequest()
        return await self.fan_out(lambda w: self.control(w, "SlowDown", request)), {}

    # ---- expert-distribution recorder (SGLang's routes; MoE models) -----------------------------

    async def start_expert_distribution_record(self, body: dict):
        _reject_unknown(body, set())
        request = apb.StartExpertDistributionRecordRequest()
        return await self.fan_out(lambda w: self.control(w, "StartExpertDistributionRecord", request)), {}

    async def stop_expert_distribution_record(self, body: dict):
        _reject_unknown(body, set())
        request = apb.StopExpertDistributionRecordRequest()
        return await self.fan_out(lambda w: self.control(w, "StopExpertDistributionRecord", request)), {}

    async def dump_expert_distribution_record(self, body: dict):
        """Each worker's dump under its result; num_steps and logical_count summed over the workers that answered
        (the deployment's routing: prefill passes and decode passes alike)."""
        _reject_unknown(body, set())
        request = apb.DumpExpertDistributionRecordRequest()

        async def dump(worker: Worker) -> WorkerResult:
            reply = await self.admin(worker).DumpExpertDistributionRecord(request, timeout=GRPC_TIMEOUT_S)
            if not reply.success:
                return WorkerResult(worker, False, reply.message, 400)
            # off the event loop: a per_pass window is a row per forward pass (megabytes)
            return WorkerResult(worker, True, reply.message, 200,
                                {"dump": await asyncio.to_thread(json.loads, reply.dump_json)})
        results = await self.fan_out(dump)
        dumps = [r.extra["dump"] for r in results if r.success]
        if not dumps:
            return results, {}
        try:
            merged = await asyncio.to_thread(merge_dumps, dumps)
        except ValueError as e:  # workers of different models: their counts do not add up
            return results, {"merge_error": str(e)}
        return results, {"num_steps": merged["num_steps"], "logical_count": merged["logical_count"]}

    # ---- LoRA (vLLM's routes; the workers' SglangScheduler RPCs) --------------------------------

    async def load_lora_adapter(self, body: dict):
        _reject_unknown(body, {"lora_name", "lora_path"})
        name = _body_field(body, "lora_name", str, required=True)
        if name == self.gateway.model_name:
            raise bad_request("lora_name", f"{name!r} is the base model's name; pick another")
        # vLLM's route has no id: the name is the id requests select it by (OpenAI `model`).
        request = pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=_body_field(body, "lora_path", str,
                                                                                 required=True), lora_id=name)

        async def load(worker: Worker) -> WorkerResult:
            reply = await worker.stub.LoadLoRAAdapter(request, timeout=GRPC_TIMEOUT_S)
            await worker.refresh_lora(GRPC_TIMEOUT_S)  # routable at once, not at the next health check
            return WorkerResult(worker, reply.success, reply.message, 200 if reply.success else 400)
        return await self.fan_out(load), {}

    async def unload_lora_adapter(self, body: dict):
        _reject_unknown(body, {"lora_name"})
        request = pb.UnloadLoRAAdapterRequest(lora_name=_body_field(body, "lora_name", str, required=True))

        async def unload(worker: Worker) -> WorkerResult:
            reply = await worker.stub.UnloadLoRAAdapter(request, timeout=GRPC_TIMEOUT_S)
            await worker.refresh_lora(GRPC_TIMEOUT_S)
            return WorkerResult(worker, reply.success, reply.message, 200 if reply.success else 400)
        return await self.fan_out(unload), {}


def lora_models(gateway, base: dict) -> list[dict]:
    """/v1/models entries of the loaded LoRA adapters, vLLM's shape: the base model is their parent."""
    return [{**base, "id": name, "root": adapter.lora_path, "parent": base["id"]}
            for name, adapter in sorted(gateway.registry.lora_adapters().items())]


# SGLang serves these for GET as well as POST.
RECORDER_ROUTES = ("start_expert_distribution_record", "stop_expert_distribution_record",
                   "dump_expert_distribution_record")
CONTROL_ROUTES = ("update_weights_from_disk", "update_weights_from_tensor", "init_weights_update_group",
                  "update_weights_from_distributed", "destroy_weights_update_group", "get_weights_by_name",
                  "release_memory_occupation", "resume_memory_occupation", "pause_generation", "continue_generation",
                  "slow_down", *RECORDER_ROUTES)


def is_admin_path(path: str) -> bool:
    """A route guarded by --admin-api-key instead of the client key."""
    return path in LORA_PATHS or path == WORKERS_PATH or path.lstrip("/") in CONTROL_ROUTES


def register(app: web.Application, gateway) -> None:
    """With --admin-api-key, the control routes (without it they stay 404)."""
    key = gateway.config.admin_api_key
    if not key:
        return
    handlers = AdminHandlers(gateway, key)
    for name in CONTROL_ROUTES:
        serve = handlers.route(name, getattr(handlers, name))
        app.router.add_post(f"/{name}", serve)
        if name in RECORDER_ROUTES:
            app.router.add_get(f"/{name}", serve, allow_head=False)
    app.router.add_post(LORA_PATHS[0], handlers.route("load_lora_adapter", handlers.load_lora_adapter))
    app.router.add_post(LORA_PATHS[1], handlers.route("unload_lora_adapter", handlers.unload_lora_adapter))
    membership_api.register(app, gateway, handlers.read_body)


def _load_safetensors(data: bytes) -> dict:
    """safetensors' torch loader, imported on first use (callers run it on a thread, off the event loop): importing
    torch costs every router seconds of start-up, and only these two runtime-control calls need it."""
    from safetensors.torch import load

    return load(data)
