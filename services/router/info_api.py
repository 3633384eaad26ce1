"""The router's utility endpoints: /tokenize and /detokenize (vLLM's shapes), /v1/models/{id}, /version, and
SGLang's /get_model_info, /get_server_info, /flush_cache and /health_generate."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import json
import time
from typing import Any

import grpc
from aiohttp import web
from smg_grpc_proto.generated import common_pb2

from tandem.common.proto_gen.tandem import admin_pb2 as apb
from tandem.common.proto_gen.tandem import admin_pb2_grpc as apb_grpc
from tandem.services.router.admin_api import lora_models
from tandem.services.router.chat_request import parse_chat_options, parse_messages
from tandem.services.router.errors import ApiError, bad_request
from tandem.services.router.gateway import Gateway
from tandem.services.router.messages import GenerationSpec, SamplingOptions
from tandem.services.router.openai_protocol import Body, parse_json_body

FLUSH_TIMEOUT_S = 30.0
FLUSH_TIERS = ("all", "device", "host", "disk")
HEALTH_GENERATE_TIMEOUT_S = 20.0
_SECRET_FIELDS = ("api_key", "ssl_keyfile")


def tandem_version() -> str:
    try:
        return importlib.metadata.version("tandem")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _check_model(gateway: Gateway, body: Body) -> None:
    model = body.get("model", (str,), None)
    if model is not None:
        gateway.check_model(model)


def tokenize_body(gateway: Gateway, data: Any) -> dict:
    """vLLM's /tokenize: {prompt} or {messages, ...chat options}; O(prompt) work, run off the event loop."""
    body = Body(data)
    known = {"model", "prompt", "messages", "add_special_tokens", "return_token_strs", "tools", "tool_choice",
             "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "documents"}
    for name in body.data:
        if name not in known:
            raise bad_request(name, "unknown field for /tokenize")
    _check_model(gateway, body)
    assets = gateway.generator.assets
    if "messages" in body.data:
        if "prompt" in body.data:
            raise bad_request("prompt", "give either prompt or messages, not both")
        messages = parse_messages(body.data["messages"])
        options, _ = parse_chat_options(body.data, body.boolean)
        spec = GenerationSpec(kind="chat", model=None, sampling=SamplingOptions(), messages=messages, chat=options)
        gateway.generator.check_prompt_chars(spec)
        text, special = gateway.generator.render_chat(spec), body.boolean("add_special_tokens", False)
    else:
        text = body.get("prompt", (str,), None)
        if text is None:
            raise bad_request("prompt", "required: a string (or send messages)")
        spec = GenerationSpec(kind="completion", model=None, sampling=SamplingOptions(), prompt=text)
        gateway.generator.check_prompt_chars(spec)
        special = body.boolean("add_special_tokens", True)
    ids = assets.encode(text, add_special_tokens=special)
    strs = ([assets.tokenizer.id_to_token(t) for t in ids] if body.boolean("return_token_strs", False) else None)
    return {"count": len(ids), "max_model_len": gateway.generator.context_length(), "tokens": ids,
            "token_strs": strs}


def detokenize_body(gateway: Gateway, data: Any) -> dict:
    body = Body(data)
    for name in body.data:
        if name not in ("model", "tokens"):
            raise bad_request(name, "unknown field for /detokenize")
    _check_model(gateway, body)
    vocab = gateway.vocab_size
    tokens = body.get("tokens", (list,), None)
    if tokens is None:
        raise bad_request("tokens", "required: an array of token ids")
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise bad_request("tokens", f"every entry must be a token id in [0, {vocab}), got {t!r}")
    return {"prompt": gateway.generator.assets.tokenizer.decode(tokens, skip_special_tokens=False)}


class InfoHandlers:
    def __init__(self, gateway: Gateway, read_body):
        self.gateway = gateway
        self.read_body = read_body

    async def _json_body(self, request: web.Request) -> Any:
        raw = await self.read_body(request, self.gateway.max_request_body_bytes())
        return await self.gateway.run_blocking(parse_json_body, raw)

    async def tokenize(self, request: web.Request) -> web.Response:
        data = await self._json_body(request)
        return web.json_response(await self.gateway.run_blocking(tokenize_body, self.gateway, data))

    async def detokenize(self, request: web.Request) -> web.Response:
        data = await self._json_body(request)
        return web.json_response(await self.gateway.run_blocking(detokenize_body, self.gateway, data))

    def model_entry(self) -> dict:
        gateway = self.gateway
        entry = {"id": gateway.model_name, "object": "model", "created": int(time.time()), "owned_by": "tandem",
                 "root": gateway.model_name}
        if gateway.assets is not None:
            entry["max_model_len"] = gateway.generator.context_length()
        return entry

    def model_entries(self) -> list[dict]:
        """The base model, then each loaded LoRA adapter with the base as its parent."""
        base = self.model_entry()
        return [base, *lora_models(self.gateway, base)]

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": self.model_entries()})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        self.gateway.check_model(name)
        return web.json_response(next(e for e in self.model_entries() if e["id"] == name))

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": tandem_version()})

    async def model_info(self, request: web.Request) -> web.Response:
        """SGLang's /get_model_info, from the workers' GetModelInfo (and the router's own tokenizer)."""
        gateway = self.gateway
        info = gateway.registry.any_model_info()
        body = {"model_path": info.model_path if info else gateway.config.model_path,
                "tokenizer_path": gateway.config.model_path or (info.tokenizer_path if info else None),
                "is_generation": info.is_generation if info else True, "served_model_name": gateway.model_name,
                "max_context_length": gateway.generator.context_length() if gateway.assets is not None else None,
                **self.weight_versions()}
        return web.json_response(body)

    def weight_versions(self) -> dict:
        """The workers' weight version (one, unless an update is fanning out) and each worker's."""
        workers = sorted(self.gateway.registry.workers.values(), key=lambda w: (w.role, w.endpoint.address))
        versions = {w.endpoint.address: w.weight_version for w in workers}
        distinct = sorted({v for v in versions.values() if v is not None})
        return {"weight_version": distinct[0] if len(distinct) == 1 else None, "worker_weight_versions": versions}

    async def server_info(self, request: web.Request) -> web.Response:
        """SGLang's /get_server_info: the router's configuration (secrets left out), its workers, version."""
        config = {f.name: getattr(self.gateway.config, f.name) for f in dataclasses.fields(self.gateway.config)
                  if f.name not in _SECRET_FIELDS and f.name != "tls"}
        return web.json_response({"version": tandem_version(), "router_args": config,
                                  "workers": self.gateway.registry.snapshot()},
                                 dumps=lambda obj: json.dumps(obj, default=str))

    async def flush_cache(self, request: web.Request) -> web.Response:
        """FlushCache on every worker: 200 when all flushed; 400 (as SGLang) when one refused because it is
        running requests; 503 when one could not be reached. An optional JSON body {"tier": ...} flushes one
        HiCache tier (device, host, disk; all is the default) through WorkerAdmin.FlushCacheTier."""
        tier = await self._flush_tier(request)
        workers = list(self.gateway.registry.workers.values())

        async def flush(worker) -> dict:
            try:
                if tier == "all":
                    reply = await worker.stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=FLUSH_TIMEOUT_S)
                else:
                    reply = await apb_grpc.WorkerAdminStub(worker.channel).FlushCacheTier(
                        apb.FlushCacheTierRequest(tier=tier), timeout=FLUSH_TIMEOUT_S)
                return {"worker": worker.endpoint.address, "success": reply.success, "message": reply.message}
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    return {"worker": worker.endpoint.address, "success": False, "message": e.details()}
                return {"worker": worker.endpoint.address, "success": False, "unreachable": True,
                        "message": e.details() or str(e.code())}

        results = await asyncio.gather(*(flush(w) for w in workers))
        ok = bool(results) and all(r["success"] for r in results)
        status = 200 if ok else 503 if any(r.get("unreachable") for r in results) or not results else 400
        return web.json_response({"success": ok, "workers": results}, status=status)

    async def _flush_tier(self, request: web.Request) -> str:
        if not request.can_read_body:
            return "all"
        data = await self._json_body(request)
        if not isinstance(data, dict) or set(data) - {"tier"}:
            raise bad_request("tier", 'the body may only be {"tier": "all|device|host|disk"}')
        tier = data.get("tier", "all")
        if tier not in FLUSH_TIERS:
            raise bad_request("tier", f"must be one of {', '.join(FLUSH_TIERS)}, got {tier!r}")
        return tier

    async def health_generate(self, request: web.Request) -> web.Response:
        """SGLang's /health_generate: one token generated through the whole path (tokenizer, workers, KV)."""
        gateway = self.gateway
        spec = GenerationSpec(kind="completion", model=None, sampling=SamplingOptions(max_tokens=1, temperature=0),
                              prompt="ping")
        try:
            req = await gateway.prepare(spec)
            async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
                async with gateway.generate(spec, req) as (deltas, usage):
                    async for _ in deltas:
                        pass
        except TimeoutError:
            raise ApiError(503, f"health_generate: no token within {HEALTH_GENERATE_TIMEOUT_S:g} s",
                           code="unhealthy") from None
        except ApiError as e:
            raise ApiError(503, f"health_generate: {e.message}", code="unhealthy") from None
        return web.json_response({"status": "ok", "completion_tokens": usage.completion_tokens})


def add_info_routes(app: web.Application, gateway: Gateway, read_body) -> None:
    handlers = InfoHandlers(gateway, read_body)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/v1/models/{model}", handlers.model)
    app.router.add_post("/tokenize", handlers.tokenize)
    app.router.add_post("/detokenize", handlers.detokenize)
    app.router.add_get("/version", handlers.version)
    app.router.add_get("/get_model_info", handlers.model_info)
    app.router.add_get("/get_server_info", handlers.server_info)
    app.router.add_post("/flush_cache", handlers.flush_cache)
    app.router.add_get("/health_generate", handlers.health_generate)
