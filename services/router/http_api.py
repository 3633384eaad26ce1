"""The OpenAI-compatible HTTP API (aiohttp): /v1/completions, /v1/chat/completions, /v1/models, health,
readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Callable, Optional

import orjson
from aiohttp import web

from tandem.common.telemetry.propagation import aiohttp_tracing
from tandem.services.router import admin_api
from tandem.services.router.embeddings import Embeddings
from tandem.services.router.errors import ApiError
from tandem.services.router.gateway import Gateway
from tandem.services.router.messages import ChoiceDelta, GenerationSpec, Usage
from tandem.services.router.batch import generate_all
from tandem.services.router.info_api import add_info_routes
from tandem.services.router.openai_protocol import ResponseShaper, parse_chat, parse_completions, parse_json_body
from tandem.services.router.schema import add_schema_routes
from tandem.services.router.session_api import add_session_routes

logger = logging.getLogger(__name__)
GATEWAY_KEY = web.AppKey("gateway", Gateway)
REQUEST_ID_KEY = "tandem_request_id"
CLIENT_ID_KEY = "tandem_client_request_id"
MAX_REQUEST_ID_CHARS = 128
WEIGHT_VERSION_HEADER = "X-Tandem-Weight-Version"
# Probes and scrapers carry no API key; everything else (generation, tokenizing, flushing) needs it.
OPEN_PATHS = frozenset({"/health", "/readiness", "/metrics", "/version", "/openapi.json", "/docs"})


def error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers)


def _sse(data: dict | str) -> bytes:
    """One server-sent event; orjson writes UTF-8 straight to bytes (as json.dumps(ensure_ascii=False) would)."""
    return b"data: " + (data.encode() if isinstance(data, str) else orjson.dumps(data)) + b"\n\n"


def request_id_of(request: web.Request) -> str:
    """The client's X-Request-Id (printable ASCII, at most 128 characters), else a new one."""
    given = request.headers.get("X-Request-Id", "")
    if 0 < len(given) <= MAX_REQUEST_ID_CHARS and given.isascii() and given.isprintable():
        return given
    return uuid.uuid4().hex


@web.middleware
async def errors_and_auth(request: web.Request, handler):
    request[REQUEST_ID_KEY] = request_id_of(request)
    request[CLIENT_ID_KEY] = request[REQUEST_ID_KEY] == request.headers.get("X-Request-Id")
    response = await _handle(request, handler)
    if not response.prepared:  # a stream set its own header before its first byte
        response.headers["X-Request-Id"] = request[REQUEST_ID_KEY]
    return response


async def _handle(request: web.Request, handler) -> web.StreamResponse:
    gateway: Gateway = request.app[GATEWAY_KEY]
    if (request.path not in OPEN_PATHS and not admin_api.is_admin_path(request.path)
            and not gateway.authorized(request.headers.get("Authorization", ""))):
        return error_response(ApiError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                       code="invalid_api_key"))
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e)
    except web.HTTPException as e:  # 404, 405 from routing: OpenAI's error shape too
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status)
        return error_response(ApiError(e.status, f"{request.method} {request.path}: {e.reason}", code=code,
                                       error_type="invalid_request_error"))
    except Exception as e:  # noqa: BLE001 - only our own bugs get here
        logger.exception("internal error on %s", request.path)
        return error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}"))


async def read_body(request: web.Request, limit: int) -> bytearray:
    """The body, or 413 as soon as it is known to exceed `limit` bytes (from Content-Length, or while reading
    a chunked body): never more than `limit` bytes and one chunk are held."""
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    body = bytearray()
    async for chunk in request.content.iter_any():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return body


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes, the most this router accepts "
                         f"(--max-request-body-bytes)", code="request_too_large")


def generation_specs(raw: bytearray, endpoint: str, vocab_size: Callable[[], int]) -> list[GenerationSpec]:
    """Body → validated specs (one per prompt): O(body) work, run off the event loop."""
    body = parse_json_body(raw)
    if endpoint == "chat":
        return [parse_chat(body, vocab_size())]
    return parse_completions(body, vocab_size())


class OpenAIHandlers:
    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        started = time.monotonic()
        status = 500
        try:
            response = await self._generate_inner(request, endpoint)
            status = response.status
            return response
        except ApiError as e:
            status = e.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            metrics = self.gateway.metrics
            metrics.http_requests.labels(endpoint, str(status)).inc()
            metrics.http_latency.labels(endpoint).observe(time.monotonic() - started)

    async def _generate_inner(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        gateway = self.gateway
        raw = await read_body(request, gateway.max_request_body_bytes())
        specs = await gateway.run_blocking(generation_specs, raw, endpoint, lambda: gateway.vocab_size)
        reqs = [await gateway.prepare(spec) for spec in specs]
        spec = specs[0]
        if not request[CLIENT_ID_KEY]:
            request[REQUEST_ID_KEY] = reqs[0].request_id  # the response's id, in the header too
        shaper = ResponseShaper(spec, reqs[0].request_id, spec.model)
        async with generate_all(gateway, specs, reqs) as (deltas, usage, prompt_logprobs):
            n = spec.sampling.n * len(specs)
            if not spec.stream:
                choices: dict[int, list[ChoiceDelta]] = {i: [] for i in range(n)}
                async for delta in deltas:
                    choices[delta.index].append(delta)
                shaper.prompt_logprobs = prompt_logprobs()
                return web.json_response(shaper.full(choices, usage), dumps=_dumps,
                                         headers=weight_version_header(usage))
            first = await anext(deltas, None)  # errors before the first token still get their HTTP status
            shaper.prompt_logprobs = prompt_logprobs()
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                   "X-Request-Id": request[REQUEST_ID_KEY],
                                                   **weight_version_header(usage)})
            await response.prepare(request)
            try:
                await self._stream(response, spec, shaper, first, deltas, usage)
            except ApiError as e:  # after the headers went out: an error event, as OpenAI's client expects
                await response.write(_sse(e.body()))
            except (ConnectionResetError, ConnectionError):
                logger.info("client disconnected from %s; cancelling it", reqs[0].request_id)
                return response
            await response.write(_sse("[DONE]"))
            await response.write_eof()
            return response

    async def _stream(self, response: web.StreamResponse, spec: GenerationSpec, shaper: ResponseShaper,
                      first: Optional[ChoiceDelta], deltas, usage) -> None:
        if spec.kind == "chat":
            for index in range(spec.sampling.n):  # chat has one prompt
                await response.write(_sse(shaper.role_chunk(index, usage.prompt_tokens)))
        if first is not None and _worth_sending(first):
            await response.write(_sse(shaper.chunk(first)))
        async for delta in deltas:
            if _worth_sending(delta):
                await response.write(_sse(shaper.chunk(delta)))
        if spec.include_usage:
            await response.write(_sse(shaper.usage_chunk(usage)))


def weight_version_header(usage: Usage) -> dict[str, str]:
    """The weight version of the worker(s) that served (after the first delta; absent when none reported one)."""
    return {WEIGHT_VERSION_HEADER: usage.weight_version} if usage.weight_version else {}


def _worth_sending(delta: ChoiceDelta) -> bool:
    """Tokens whose text is still held back (a split character, a possible stop string) make no chunk."""
    return bool(delta.text or delta.logprobs or delta.finish_reason or delta.reasoning or delta.tool_calls)


def _dumps(obj) -> str:
    return orjson.dumps(obj).decode()


async def health(request: web.Request) -> web.Response:
    """Liveness: the process serves HTTP."""
    return web.json_response({"status": "ok"})


async def readiness(request: web.Request) -> web.Response:
    """Ready when the tokenizer is loaded and a unified worker or a prefill/decode pair is healthy."""
    gateway: Gateway = request.app[GATEWAY_KEY]
    ready, message = gateway.ready()
    return web.json_response({"ready": ready, "message": message, "workers": gateway.registry.snapshot()},
                             status=200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    gateway: Gateway = request.app[GATEWAY_KEY]
    return web.Response(body=gateway.metrics.render(), content_type="text/plain", charset="utf-8")


def build_app(gateway: Gateway) -> web.Application:
    # Bodies are read by read_body, against Gateway.max_request_body_bytes (which follows the context length).
    app = web.Application(middlewares=[errors_and_auth])
    aiohttp_tracing(app)  # outermost: the request span covers auth, errors and the whole stream
    app[GATEWAY_KEY] = gateway
    handlers = OpenAIHandlers(gateway)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/embeddings", Embeddings(gateway).http)
    add_info_routes(app, gateway, read_body)
    add_schema_routes(app)
    add_session_routes(app, gateway, read_body)
    app.router.add_get("/health", health)
    app.router.add_get("/readiness", readiness)
    app.router.add_get("/metrics", metrics)
    admin_api.register(app, gateway)
    return app
