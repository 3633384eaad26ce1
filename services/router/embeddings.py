"""`POST /v1/embeddings` (OpenAI's request and response shape): inputs tokenized here, each embedded by the
SglangScheduler `Embed` RPC of a unified or prefill worker (pooling: the workers' --embedding-pooling)."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from dataclasses import dataclass
from typing import Optional

import grpc
from aiohttp import web
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tandem.common.roles import Role
from tandem.services.router.errors import ApiError, bad_request
from tandem.services.router.gateway import Gateway

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
_FIELDS = {"input", "model", "encoding_format", "dimensions"}


@dataclass
class EmbeddingSpec:
    model: Optional[str]
    texts: Optional[list[str]]  # to tokenize here
    token_ids: Optional[list[list[int]]]  # already tokenized
    encoding_format: str
    dimensions: Optional[int]


def parse_embedding_request(raw: bytes, vocab_size: int) -> EmbeddingSpec:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    return parse_embedding_body(body, vocab_size)


def parse_embedding_body(body, vocab_size: int) -> EmbeddingSpec:
    """The body as an EmbeddingSpec; 400 naming the field for anything OpenAI's API would refuse or we cannot do."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise bad_request(unknown[0], f"unknown or unsupported field; supported: {sorted(_FIELDS)}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model", "must be a string")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise bad_request("encoding_format", f"must be 'float' or 'base64', got {encoding!r}")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1):
        raise bad_request("dimensions", f"must be a positive integer, got {dimensions!r}")
    texts, token_ids = _inputs(body.get("input"), vocab_size)
    return EmbeddingSpec(model, texts, token_ids, encoding, dimensions)


def _inputs(value, vocab_size: int) -> tuple[Optional[list[str]], Optional[list[list[int]]]]:
    """OpenAI's four spellings: a string, strings, token ids, lists of token ids."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request("input", "must be a non-empty string, list of strings, list of token ids or list of lists")
    if len(value) > MAX_INPUTS:
        raise bad_request("input", f"at most {MAX_INPUTS} inputs per request, got {len(value)}")
    if all(isinstance(v, str) for v in value):
        if any(not v for v in value):
            raise bad_request("input", "strings must not be empty")
        return value, None
    if all(_is_id(v) for v in value):
        value = [value]
    if all(isinstance(v, list) and v and all(_is_id(t) for t in v) for v in value):
        bad = next((t for v in value for t in v if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request("input", f"token id {bad} is out of vocabulary (ids must be in [0, {vocab_size}))")
        return None, value
    raise bad_request("input", "must be a string, a list of strings, a list of token ids or a list of non-empty "
                               "lists of token ids (not a mix)")


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _encode(vector, encoding: str):
    if encoding == "float":
        return list(vector)
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()  # OpenAI's: little-endian float32


@dataclass
class EmbeddingResult:
    vectors: list[list[float]]
    prompt_tokens: int


class Embeddings:
    """What /v1/embeddings and the router gRPC API's Embed share: tokenize, embed every input on the workers."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    async def create(self, spec: EmbeddingSpec) -> EmbeddingResult:
        gateway = self.gateway
        if spec.model is not None:
            gateway.check_model(spec.model)
        ids = spec.token_ids
        if ids is None:
            ids = await gateway.run_blocking(lambda: [gateway.assets.encode(t) for t in spec.texts])
        limit = gateway.registry.max_context_length()
        too_long = next((i for i, v in enumerate(ids) if limit and len(v) >= limit), None)
        if too_long is not None:
            raise bad_request("input", f"input {too_long} has {len(ids[too_long])} tokens; the context length is "
                                       f"{limit}")
        responses = await asyncio.gather(*(self._embed(v) for v in ids))
        dim = responses[0].embedding_dim
        if spec.dimensions is not None and spec.dimensions != dim:
            raise bad_request("dimensions", f"this model's embeddings have {dim} dimensions; shortening them "
                                            f"(Matryoshka) is not supported")
        return EmbeddingResult([list(r.embedding) for r in responses], sum(r.prompt_tokens for r in responses))

    async def http(self, request: web.Request) -> web.Response:
        from tandem.services.router.http_api import read_body  # import cycle: http_api imports this module

        gateway = self.gateway
        if gateway.assets is None:
            raise ApiError(503, "the router has not loaded the tokenizer yet", code="no_healthy_worker")
        raw = await read_body(request, gateway.max_request_body_bytes())
        spec = await gateway.run_blocking(parse_embedding_request, bytes(raw), gateway.vocab_size)
        result = await self.create(spec)
        data = [{"object": "embedding", "index": i, "embedding": _encode(v, spec.encoding_format)}
                for i, v in enumerate(result.vectors)]
        usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
        return web.json_response({"object": "list", "data": data, "model": gateway.model_name, "usage": usage})

    async def _embed(self, input_ids: list[int]) -> pb.EmbedResponse:
        """One input on the least loaded unified or prefill worker (a decode worker does not embed)."""
        registry = self.gateway.registry
        workers = registry.by_role(Role.UNIFIED) or registry.by_role(Role.PREFILL)
        if not workers:
            raise ApiError(503, "no healthy unified or prefill worker to compute embeddings", code="no_healthy_worker")
        worker = min(workers, key=lambda w: w.load_score())
        worker.in_flight += 1
        try:
            return await worker.stub.Embed(pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=input_ids)),
                                           timeout=self.gateway.config.request_timeout_s)
        except grpc.aio.AioRpcError as e:
            status = 400 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 503
            raise ApiError(status, f"embedding failed on {worker.endpoint.address}: {e.details()}") from None
        finally:
            worker.in_flight -= 1
