"""The router's text-level gRPC API (tandem.router.v1.Router), plus grpc.health.v1 and reflection.

Requests are turned into the OpenAI JSON shape and validated by the same code as HTTP, so both APIs accept
the same parameters and reject bad ones with the same messages."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.proto_gen.tandem import router_pb2 as rpb
from common.proto_gen.tandem import router_pb2_grpc as rpb_grpc
from common.telemetry.propagation import extract_grpc, trace_id_metadata
from common.telemetry.tracing import router_request_span
from services.router.errors import ApiError
from services.router.gateway import Gateway
from services.router.messages import ChoiceDelta, GenerationSpec, Usage
from services.router.openai_protocol import parse_chat, parse_completion

SERVICE_NAME = rpb.DESCRIPTOR.services_by_name["Router"].full_name
READINESS_POLL_S = 1.0
_OPTIONAL_SAMPLING = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                      "presence_penalty", "repetition_penalty", "ignore_eos", "seed", "n", "skip_special_tokens")


def _sampling_fields(sp: rpb.SamplingParams) -> dict:
    body = {name: getattr(sp, name) for name in _OPTIONAL_SAMPLING if sp.HasField(name)}
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        if name in body:
            body[name] = round(body[name], 6)  # float32 on the wire: 0.1 arrives as 0.10000000149
    if sp.stop:
        body["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        body["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in sp.logit_bias.items()}
    return body


def completion_body(request: rpb.GenerateRequest) -> dict:
    body = {"model": request.model, **_sampling_fields(request.sampling_params)}
    which = request.WhichOneof("prompt")
    if which == "text":
        body["prompt"] = request.text
    elif which == "token_ids":
        body["prompt"] = list(request.token_ids.ids)
    if request.HasField("logprobs"):
        body["logprobs"] = request.logprobs
    if request.user:
        body["user"] = request.user
    return body


def chat_body(request: rpb.ChatRequest) -> dict:
    body = {"model": request.model, **_sampling_fields(request.sampling_params),
            "messages": [{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
                         for m in request.messages]}
    if request.logprobs:
        body["logprobs"] = True
    if request.HasField("top_logprobs"):
        body["top_logprobs"] = request.top_logprobs
    if request.user:
        body["user"] = request.user
    return body


def chunk_message(request_id: str, delta: ChoiceDelta) -> rpb.GenerateResponse:
    chunk = rpb.Chunk(index=delta.index, text=delta.text, token_ids=delta.token_ids,
                      finish_reason=delta.finish_reason or "")
    for e in delta.logprobs:
        entry = chunk.logprobs.add(token_id=e.token_id, token=e.token, logprob=e.logprob)
        for token_id, token, logprob in e.top:
            entry.top_logprobs.add(token_id=token_id, token=token, logprob=logprob)
    return rpb.GenerateResponse(id=request_id, chunk=chunk)


def usage_message(request_id: str, usage: Usage) -> rpb.GenerateResponse:
    msg = rpb.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                    cached_tokens=usage.cached_tokens)
    for value in usage.prompt_logprobs or []:
        entry = msg.prompt_logprobs.add()
        if value is not None:
            entry.logprob = value
    return rpb.GenerateResponse(id=request_id, usage=msg)


class RouterServicer(rpb_grpc.RouterServicer):
    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    def _check_auth(self, context) -> None:
        if not self.gateway.authorized(dict(context.invocation_metadata()).get("authorization", "")):
            raise ApiError(401, "invalid or missing API key (metadata authorization: Bearer ...)")

    async def _serve(self, spec_of, body_of, request, context) -> AsyncIterator[rpb.GenerateResponse]:
        with router_request_span(parent=extract_grpc(context.invocation_metadata()),
                                 attributes={"rpc.system": "grpc", "rpc.method": type(request).__name__}):
            metadata = trace_id_metadata()  # x-trace-id names the request's trace; empty when tracing is off
            if metadata:
                await context.send_initial_metadata(metadata)
            async for response in self._generate(spec_of, body_of, request, context):
                yield response

    async def _generate(self, spec_of, body_of, request, context) -> AsyncIterator[rpb.GenerateResponse]:
        gateway = self.gateway
        try:
            self._check_auth(context)
            spec: GenerationSpec = spec_of(body_of(request), gateway.vocab_size)
            if isinstance(request, rpb.GenerateRequest):
                spec.prompt_logprobs = request.prompt_logprobs
            req = await gateway.prepare(spec)
            async with gateway.generate(spec, req) as (deltas, usage):
                async for delta in deltas:
                    yield chunk_message(req.request_id, delta)
            yield usage_message(req.request_id, usage)
        except ApiError as e:  # Retry-After of a 429 travels as trailing metadata "retry-after"
            await context.abort(e.grpc_code, e.message,
                                trailing_metadata=tuple((k.lower(), v) for k, v in e.headers.items()))

    async def Generate(self, request: rpb.GenerateRequest, context) -> AsyncIterator[rpb.GenerateResponse]:
        async for response in self._serve(parse_completion, completion_body, request, context):
            yield response

    async def Chat(self, request: rpb.ChatRequest, context) -> AsyncIterator[rpb.GenerateResponse]:
        async for response in self._serve(parse_chat, chat_body, request, context):
            yield response

    async def ListModels(self, request, context) -> rpb.ListModelsResponse:
        try:
            self._check_auth(context)
        except ApiError as e:
            await context.abort(e.grpc_code, e.message)
        gateway = self.gateway
        length = gateway.generator.context_length() if gateway.assets is not None else 0
        return rpb.ListModelsResponse(models=[rpb.Model(id=gateway.model_name, max_model_len=length)])


class GrpcApi:
    """The gRPC server; its grpc.health.v1 status follows the router's readiness."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway
        self.server = grpc.aio.server()
        rpb_grpc.add_RouterServicer_to_server(RouterServicer(gateway), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        self._task: asyncio.Task | None = None

    async def start(self, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> int:
        """Listen (with TLS when `credentials` are given) and serve; returns the bound port."""
        address = f"{host}:{port}"
        bound = (self.server.add_secure_port(address, credentials) if credentials is not None
                 else self.server.add_insecure_port(address))
        if not bound:
            raise OSError(f"cannot listen on {host}:{port} for the gRPC API")
        await self.server.start()
        self._task = asyncio.create_task(self._follow_readiness(), name="grpc-health")
        return bound

    async def _follow_readiness(self) -> None:
        serving = None
        while True:
            ready = self.gateway.ready()[0]
            if ready != serving:
                status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
                for service in ("", SERVICE_NAME):
                    await self.health.set(service, status)
                serving = ready
            await asyncio.sleep(READINESS_POLL_S)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.server.stop(grace=1.0)
