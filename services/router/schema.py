"""The HTTP API's bodies as pydantic models, and the /openapi.json and /docs built from them (a test keeps these
models' fields equal to the fields openai_protocol.py accepts, so the document cannot drift from the code)."""

from __future__ import annotations

import functools
from typing import Any, Literal, Optional, Union

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, RootModel
from pydantic.json_schema import models_json_schema

from tandem.common.sampling.params import MAX_TOP_LOGPROBS

Number = float


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = Field(
        False, description="vLLM's: usage (the prompt's tokens, the choice's so far) on every chunk; "
                           "only with include_usage")


class JsonSchemaFormat(Strict):
    name: str
    description: Optional[str] = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class SessionParams(Strict):
    """SGLang's session_params: the request is a turn of an open session (docs/api.md, Sessions)."""

    id: str = Field(min_length=1, max_length=256, description="the session's id (from /open_session)")
    rid: Optional[str] = Field(None, description="the turn to continue (its response id); default: the last")
    offset: Optional[int] = Field(None, ge=0, description="keep only the parent turn's first tokens (0: all)")
    replace: Optional[bool] = Field(None, description="drop the parent turn's other children")


class OpenSessionRequest(Strict):
    capacity_of_str_len: int = Field(ge=1, description="the most tokens a turn's prompt may have, and the session "
                                                       "may keep pinned on a worker")
    session_id: Optional[str] = Field(None, min_length=1, max_length=256, description="default: a new hex id")


class CloseSessionRequest(Strict):
    session_id: str = Field(min_length=1, max_length=256)


class SessionId(RootModel[str]):
    """/open_session's answer: the session's id, a JSON string."""


class SamplingFields(Strict):
    """Fields both generation endpoints take (vLLM's extensions included)."""

    model: Optional[str] = Field(None, min_length=1, description="default: the served model")
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    temperature: Number = Field(1.0, ge=0, le=2)
    top_p: Number = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=2**31 - 1)
    min_p: Number = Field(0.0, ge=0, le=1)
    frequency_penalty: Number = Field(0.0, ge=-2, le=2)
    presence_penalty: Number = Field(0.0, ge=-2, le=2)
    repetition_penalty: Number = Field(1.0, gt=0, le=2)
    stop: Optional[Union[str, list[str]]] = Field(None, description="at most 16 non-empty strings")
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    logit_bias: Optional[dict[str, Number]] = Field(None, description="token id (ASCII digits) -> [-100, 100]")
    seed: Optional[int] = Field(None, ge=-2**53, le=2**53)
    n: int = Field(1, ge=1, le=64)
    best_of: Optional[int] = Field(None, ge=1, description="must equal n")
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: Optional[ResponseFormat] = None
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=0, description="0: each prompt token's own logprob")
    functions: Optional[list] = Field(None, description="refused (deprecated): use tools")
    function_call: Optional[Any] = Field(None, description="refused (deprecated): use tool_choice")
    suffix: Optional[str] = Field(None, description="refused: insertion is not supported")
    audio: Optional[Any] = Field(None, description="refused: audio output is not supported")
    prediction: Optional[Any] = Field(None, description="refused: predicted outputs are not supported")
    session_params: Optional[SessionParams] = None


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int], list[Union[str, list[int]]]] = Field(
        ..., description="a string, token ids, or an array of either (at most 64 prompts)")
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: Union[str, dict[str, Any]] = Field(..., description="a JSON object (as text or as an object)")


class ToolCall(Strict):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """Other fields of a message (refusal, annotations, ...) are allowed and not used: clients send back the
    assistant messages they were given, with every field of the response."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = Field(None, description="assistant messages only")
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None


class FunctionDefinition(Strict):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateFields(Strict):
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: Optional[list[dict[str, Any]]] = None


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    parallel_tool_calls: Optional[bool] = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[dict[str, int]] = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[dict[str, Any]] = None
    finish_reason: Optional[Literal["stop", "length", "abort"]] = None
    prompt_logprobs: Optional[list[Optional[dict[str, Any]]]] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[dict[str, Any]] = None
    finish_reason: Optional[Literal["stop", "length", "tool_calls", "abort"]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: Optional[list[Optional[dict[str, Any]]]] = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class TokenizeRequest(ChatTemplateFields):
    model: Optional[str] = Field(None, min_length=1)
    prompt: Optional[str] = Field(None, description="give prompt or messages")
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = Field(None, description="default true for prompt, false for messages")
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(Strict):
    model: Optional[str] = Field(None, min_length=1)
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class EmbeddingRequest(Strict):
    input: Union[str, list[str], list[int], list[list[int]]] = Field(
        ..., description="a string, strings, token ids, or lists of token ids")
    model: Optional[str] = Field(None, min_length=1)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, ge=1)


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: Union[list[float], str]


class EmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: dict[str, int]


class Version(BaseModel):
    version: str


# (method, path, summary, request body model, 200 response model or None for free-form JSON)
ROUTES = [
    ("post", "/v1/completions", "Complete prompts", CompletionRequest, CompletionResponse),
    ("post", "/v1/chat/completions", "Continue a conversation", ChatCompletionRequest, ChatCompletionResponse),
    ("post", "/v1/embeddings", "Embed texts or token ids", EmbeddingRequest, EmbeddingResponse),
    ("get", "/v1/models", "The served model", None, ModelList),
    ("get", "/v1/models/{model}", "One model", None, ModelCard),
    ("post", "/tokenize", "Tokenize a prompt or a conversation (vLLM)", TokenizeRequest, TokenizeResponse),
    ("post", "/detokenize", "Token ids to text (vLLM)", DetokenizeRequest, DetokenizeResponse),
    ("get", "/version", "Tandem's version", None, Version),
    ("get", "/get_model_info", "The model (SGLang)", None, None),
    ("get", "/get_server_info", "The router's configuration and workers (SGLang)", None, None),
    ("post", "/flush_cache", "Flush every worker's prefix cache (SGLang)", None, None),
    ("post", "/open_session", "Open a session; the answer is its id, a JSON string (SGLang)", OpenSessionRequest,
     SessionId),
    ("post", "/close_session", "Close a session: its workers release its KV (SGLang)", CloseSessionRequest, None),
    ("get", "/health_generate", "Generate one token end to end (SGLang)", None, None),
    ("get", "/health", "Liveness", None, None),
    ("get", "/readiness", "Readiness", None, None),
]


@functools.cache
def openapi_document() -> dict:
    models = {m for _, _, _, req, resp in ROUTES for m in (req, resp) if m is not None} | {ErrorResponse}
    refs, schema = models_json_schema([(m, "validation" if m in _requests() else "serialization") for m in models],
                                      ref_template="#/components/schemas/{model}")
    paths: dict = {}
    error = {"description": "an error (OpenAI's shape)", "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for method, path, summary, request, response in ROUTES:
        ok = {"description": "OK", "content": {"application/json": {"schema": (
            refs[(response, "serialization")] if response is not None else {"type": "object"})}}}
        operation: dict = {"summary": summary, "responses": {"200": ok, "default": error}}
        if request is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": refs[(request, "validation")]}}}
        if "{model}" in path:
            operation["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
        paths.setdefault(path, {})[method] = operation
    return {"openapi": "3.1.0", "info": {"title": "Tandem router", "version": "v1"}, "paths": paths,
            "components": {"schemas": schema.get("$defs", {})}}


def _requests() -> set:
    return {req for _, _, _, req, _ in ROUTES if req is not None}


# Swagger UI's assets come from a CDN (jsdelivr) when a browser opens /docs; nothing else needs the network.
DOCS_HTML = """<!doctype html>
<html><head><title>Tandem router API</title><meta charset="utf-8">
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>window.ui = SwaggerUIBundle({url: "/openapi.json", dom_id: "#swagger-ui"});</script>
</body></html>
"""


async def openapi_json(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


async def docs(request: web.Request) -> web.Response:
    return web.Response(text=DOCS_HTML, content_type="text/html")


def add_schema_routes(app: web.Application) -> None:
    app.router.add_get("/openapi.json", openapi_json)
    app.router.add_get("/docs", docs)
