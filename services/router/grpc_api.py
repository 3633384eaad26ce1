"""The router's text-level gRPC API (tandem.router.v1.Router), plus grpc.health.v1 and reflection.

Requests are turned into the OpenAI JSON shape and validated by the same code as HTTP, so both APIs accept
the same parameters and reject bad ones with the same messages."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.common.proto_gen.tandem import router_pb2 as rpb
from tandem.common.proto_gen.tandem import router_pb2_grpc as rpb_grpc
from tandem.common.telemetry.propagation import extract_grpc, trace_id_metadata
from tandem.common.telemetry.tracing import router_request_span
from tandem.services.router.embeddings import Embeddings, parse_embedding_body
from tandem.services.router.errors import ApiError, bad_request
from tandem.services.router.gateway import Gateway
from tandem.services.router.info_api import detokenize_body, tokenize_body
from tandem.services.router.messages import ChoiceDelta, GenerationSpec, Usage
from tandem.services.router.openai_protocol import JsonConstant, check_json_values, parse_chat, parse_completion

SERVICE_NAME = rpb.DESCRIPTOR.services_by_name["Router"].full_name
READINESS_POLL_S = 1.0
WEIGHT_VERSION_METADATA = "x-tandem-weight-version"
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
    if sp.include_stop_str_in_output:
        body["include_stop_str_in_output"] = True
    return body


def _json_text(text: str, field: str):
    try:
        value = json.loads(text, parse_constant=JsonConstant)
    except (ValueError, RecursionError) as e:
        raise bad_request(field, f"is not valid JSON: {e}") from None
    check_json_values(value)  # NaN, depth: the rules of an HTTP body
    return value


def _response_format(request, body: dict) -> None:
    if not request.HasField("response_format"):
        return
    rf = request.response_format
    value: dict = {"type": rf.type}
    if rf.type == "json_schema":
        value["json_schema"] = {"name": rf.name, "strict": rf.strict,
                                "schema": _json_text(rf.json_schema or "{}", "response_format.json_schema")}
    body["response_format"] = value


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
    if request.echo:
        body["echo"] = True
    if request.prompt_logprobs:
        body["prompt_logprobs"] = 0
    _response_format(request, body)
    return _without_empty_model(body)


def _without_empty_model(body: dict) -> dict:
    if not body["model"]:
        del body["model"]  # optional, as over HTTP: the served model
    return body


def _message(m: rpb.ChatMessage) -> dict:
    message: dict = {"role": m.role, "content": m.content}
    for name in ("name", "tool_call_id", "reasoning_content"):
        if getattr(m, name):
            message[name] = getattr(m, name)
    if m.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                              "arguments": c.arguments or "{}"}}
                                 for c in m.tool_calls]
    return message


def chat_body(request: rpb.ChatRequest) -> dict:
    body = {"model": request.model, **_sampling_fields(request.sampling_params),
            "messages": [_message(m) for m in request.messages]}
    if request.logprobs:
        body["logprobs"] = True
    if request.HasField("top_logprobs"):
        body["top_logprobs"] = request.top_logprobs
    if request.user:
        body["user"] = request.user
    body.update(chat_template_fields(request))
    _response_format(request, body)
    return _without_empty_model(body)


def chat_template_fields(request: rpb.ChatRequest) -> dict:
    """Tools, tool_choice and the template options of a ChatRequest, in the HTTP body's shape."""
    body: dict = {}
    if request.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description else {}),
            **({"parameters": _json_text(t.parameters, f"tools[{i}].parameters")} if t.parameters else {})}}
            for i, t in enumerate(request.tools)]
    which = request.tool_choice.WhichOneof("choice") if request.HasField("tool_choice") else None
    if which == "mode":
        body["tool_choice"] = request.tool_choice.mode
    elif which == "function":
        body["tool_choice"] = {"type": "function", "function": {"name": request.tool_choice.function}}
    if request.chat_template_kwargs:
        body["chat_template_kwargs"] = _json_text(request.chat_template_kwargs, "chat_template_kwargs")
    if request.HasField("add_generation_prompt"):
        body["add_generation_prompt"] = request.add_generation_prompt
    if request.continue_final_message:
        body["continue_final_message"] = True
    return body


def tokenize_request_body(request: rpb.TokenizeRequest) -> dict:
    body: dict = {"model": request.model}
    if request.WhichOneof("input") == "chat":
        chat = request.chat
        body.update(messages=[_message(m) for m in chat.messages], **chat_template_fields(chat))
    else:
        body["prompt"] = request.text
    if request.HasField("add_special_tokens"):
        body["add_special_tokens"] = request.add_special_tokens
    return _without_empty_model(body)


def chunk_message(request_id: str, delta: ChoiceDelta, continuous_usage: bool = False) -> rpb.GenerateResponse:
    chunk = rpb.Chunk(index=delta.index, text=delta.text, token_ids=delta.token_ids,
                      finish_reason=delta.finish_reason or "", reasoning_content=delta.reasoning)
    if continuous_usage:
        chunk.usage.prompt_tokens, chunk.usage.completion_tokens = delta.prompt_tokens, delta.completion_tokens
    for call in delta.tool_calls:
        chunk.tool_calls.add(index=call.index, id=call.id or "", name=call.name or "", arguments=call.arguments)
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


class InitialMetadata:
    """A Generate/Chat stream's initial metadata, sent once, with its first message (or its error):
    x-trace-id (when tracing) and x-tandem-weight-version, the serving worker's, known only once it answered."""

    def __init__(self, context):
        self.context = context
        self.sent = False

    async def send(self, weight_version: Optional[str]) -> None:
        if self.sent:
            return
        self.sent = True
        metadata = trace_id_metadata()  # empty when tracing is off
        if weight_version:
            metadata.append((WEIGHT_VERSION_METADATA, weight_version))
        if metadata:
            await self.context.send_initial_metadata(metadata)


class RouterServicer(rpb_grpc.RouterServicer):
    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    def _check_auth(self, context) -> None:
        if not self.gateway.authorized(dict(context.invocation_metadata()).get("authorization", "")):
            raise ApiError(401, "invalid or missing API key (metadata authorization: Bearer ...)")

    async def _serve(self, spec_of, body_of, request, context) -> AsyncIterator[rpb.GenerateResponse]:
        with router_request_span(parent=extract_grpc(context.invocation_metadata()),
                                 attributes={"rpc.system": "grpc", "rpc.method": type(request).__name__}):
            initial = InitialMetadata(context)
            async for response in self._generate(spec_of, body_of, request, context, initial):
                yield response

    async def _generate(self, spec_of, body_of, request, context, initial: "InitialMetadata"
                        ) -> AsyncIterator[rpb.GenerateResponse]:
        gateway = self.gateway
        try:
            self._check_auth(context)
            spec: GenerationSpec = spec_of(body_of(request), gateway.vocab_size)
            # the final Usage always comes here, so HTTP's include_usage condition is met
            spec.continuous_usage = request.continuous_usage_stats
            req = await gateway.prepare(spec)
            async with gateway.generate(spec, req) as (deltas, usage):
                async for delta in deltas:
                    await initial.send(usage.weight_version)
                    yield chunk_message(req.request_id, delta, spec.continuous_usage)
            await initial.send(usage.weight_version)
            yield usage_message(req.request_id, usage)
        except ApiError as e:  # Retry-After of a 429 travels as trailing metadata "retry-after"
            await initial.send(None)
            await context.abort(e.grpc_code, e.message,
                                trailing_metadata=tuple((k.lower(), v) for k, v in e.headers.items()))

    async def Generate(self, request: rpb.GenerateRequest, context) -> AsyncIterator[rpb.GenerateResponse]:
        async for response in self._serve(parse_completion, completion_body, request, context):
            yield response

    async def Chat(self, request: rpb.ChatRequest, context) -> AsyncIterator[rpb.GenerateResponse]:
        async for response in self._serve(parse_chat, chat_body, request, context):
            yield response

    async def Embed(self, request: rpb.EmbedRequest, context) -> rpb.EmbedResponse:
        gateway = self.gateway
        body: dict = {"input": list(request.texts) or [list(t.ids) for t in request.token_ids]}
        if request.model:
            body["model"] = request.model
        if request.HasField("dimensions"):
            body["dimensions"] = request.dimensions
        try:
            self._check_auth(context)
            if request.texts and request.token_ids:
                raise ApiError(400, "input: give texts or token_ids, not both", param="input")
            if gateway.assets is None:
                raise ApiError(503, "the router has not loaded the tokenizer yet", code="no_healthy_worker")
            result = await Embeddings(gateway).create(parse_embedding_body(body, gateway.vocab_size))
        except ApiError as e:
            await context.abort(e.grpc_code, e.message)
        data = [rpb.Embedding(index=i, values=v) for i, v in enumerate(result.vectors)]
        return rpb.EmbedResponse(model=gateway.model_name, data=data, prompt_tokens=result.prompt_tokens)

    async def ListModels(self, request, context) -> rpb.ListModelsResponse:
        try:
            self._check_auth(context)
        except ApiError as e:
            await context.abort(e.grpc_code, e.message)
        gateway = self.gateway
        length = gateway.generator.context_length() if gateway.assets is not None else 0
        return rpb.ListModelsResponse(models=[rpb.Model(id=gateway.model_name, max_model_len=length)])

    async def Tokenize(self, request: rpb.TokenizeRequest, context) -> rpb.TokenizeResponse:
        try:
            self._check_auth(context)
            body = tokenize_request_body(request)
            reply = await self.gateway.run_blocking(tokenize_body, self.gateway, body)
            return rpb.TokenizeResponse(tokens=reply["tokens"], max_model_len=reply["max_model_len"])
        except ApiError as e:
            await context.abort(e.grpc_code, e.message)

    async def Detokenize(self, request: rpb.DetokenizeRequest, context) -> rpb.DetokenizeResponse:
        try:
            self._check_auth(context)
            body = _without_empty_model({"model": request.model, "tokens": list(request.tokens)})
            reply = await self.gateway.run_blocking(detokenize_body, self.gateway, body)
            return rpb.DetokenizeResponse(text=reply["prompt"])
        except ApiError as e:
            await context.abort(e.grpc_code, e.message)


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
