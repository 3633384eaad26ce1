"""tandem-resumed-output-tokens at the gRPC edge, in process: on a Generate call's metadata and on a Multiplex
stream's Start.metadata a seeded, JSON-schema-constrained continuation equals the rest of the original; a bad value
is INVALID_ARGUMENT naming the key."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from typing import AsyncIterator

import grpc
import pytest
from google.protobuf import struct_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.roles import Role
from tandem.common.rpc.resume import RESUMED_OUTPUT_TOKENS_KEY, resume_metadata
from tandem.common.rpc.server import WorkerServer
from tandem.common.rpc.servicer import WorkerInfo
from tandem.common.rpc.stream_client import Ended, WorkerStream
from tandem.common.rpc.unified_worker import UnifiedServicer
from tandem.common.telemetry.metrics import WorkerMetrics

PROMPT = [5, 40, 41, 97, 12, 300, 7]
SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "eel"]},
                                           "id": {"type": "integer", "minimum": 0, "maximum": 9999}},
          "required": ["kind", "id"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    config = EngineConfig(model_path=tiny_llama, max_total_tokens=4096, page_size=4, max_context_len=1024,
                          constrained_json_disable_any_whitespace=True)
    with Engine(config) as eng:
        yield eng


@asynccontextmanager
async def worker(engine) -> AsyncIterator[grpc.aio.Channel]:
    servicer = UnifiedServicer(engine, WorkerInfo("tiny"), WorkerMetrics.off(Role.UNIFIED))
    server = WorkerServer(servicer, "127.0.0.1", 0)
    port = await server.start()
    await server.set_serving()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.drain(0.0)


def request(rid: str, ids: list[int], max_new: int) -> pb.GenerateRequest:
    seed = struct_pb2.Struct()
    seed.update({"seed": 77})
    params = pb.SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=max_new, json_schema=json.dumps(SCHEMA),
                               custom_params=seed)
    return pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=ids), stream=True,
                              sampling_params=params)


async def generate(channel, req: pb.GenerateRequest, metadata=()) -> list[int]:
    responses = [r async for r in pb_grpc.SglangSchedulerStub(channel).Generate(req, metadata=metadata, timeout=60)]
    return list(responses[-1].complete.output_ids)


async def multiplexed(channel, req: pb.GenerateRequest, metadata) -> tuple[list[int], Ended]:
    replies: asyncio.Queue = asyncio.Queue()
    stream = WorkerStream(channel, "in-process")
    stream.start(req, replies.put_nowait, metadata=list(metadata))
    responses = []
    while not isinstance(reply := await asyncio.wait_for(replies.get(), 60), Ended):
        responses.append(reply)
    stream.close()
    return (list(responses[-1].complete.output_ids) if responses else []), reply


def test_a_continuation_on_generate_and_multiplex_equals_the_original(engine):
    async def scenario():
        async with worker(engine) as channel:
            original = await generate(channel, request("orig", PROMPT, 120))
            k = len(original) // 2
            meta = resume_metadata(k)
            on_call = await generate(channel, request("call", PROMPT + original[:k], 120 - k), meta)
            on_stream, ended = await multiplexed(channel, request("stream", PROMPT + original[:k], 120 - k), meta)
            return original, k, on_call, on_stream, ended

    original, k, on_call, on_stream, ended = asyncio.run(scenario())
    assert len(original) >= 6
    assert on_call == original[k:]
    assert ended.code == grpc.StatusCode.OK and on_stream == original[k:]


@pytest.mark.parametrize("value", ["0", "abc", "-1", str(len(PROMPT)), "1.5"])
def test_a_bad_value_is_invalid_argument_naming_the_key(engine, value):
    async def scenario():
        async with worker(engine) as channel:
            meta = ((RESUMED_OUTPUT_TOKENS_KEY, value),)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(channel, request("bad", PROMPT, 8), meta)
            _, ended = await multiplexed(channel, request("bad-stream", PROMPT, 8), meta)
            return info.value, ended

    error, ended = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and RESUMED_OUTPUT_TOKENS_KEY in error.details()
    assert ended.code == grpc.StatusCode.INVALID_ARGUMENT and RESUMED_OUTPUT_TOKENS_KEY in ended.details


def test_output_the_constraint_refuses_is_invalid_argument(engine):
    async def scenario():
        async with worker(engine) as channel:
            eos = sorted(engine.model_config.eos_token_ids)[0]  # a stop token before the object even opened
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(channel, request("refused", PROMPT + [eos], 8), resume_metadata(1))
            return info.value

    error = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and RESUMED_OUTPUT_TOKENS_KEY in error.details()
