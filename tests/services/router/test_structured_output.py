"""Structured output end to end: the official `openai` client's `.parse()` with a pydantic model and a forced tool
call, through a real router (hermes tool-call parser) and a real worker whose grammar makes the random tiny model's
output valid by construction."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.services.router.conftest import RouterProcess, readiness, start_worker, wait_until

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}


class Pet(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog", "eel"]


@pytest.fixture(scope="module")
def client(tiny_llama):
    from openai import OpenAI

    from common.launcher.children import free_port

    worker = start_worker(tiny_llama, free_port(), "--constrained-json-disable-any-whitespace")
    address = "127.0.0.1:" + re.search(r":(\d+)", worker.ready.group(0)).group(1)
    router = RouterProcess("--worker", f"grpc://{address}", "--model-path", tiny_llama, "--served-model-name", "tiny",
                           "--tool-call-parser", "hermes")
    try:
        wait_until(lambda: readiness(router) == 200, 60, "router readiness")
        with OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
            yield c
    finally:
        router.stop()
        worker.stop()


def test_parse_with_a_pydantic_model(client):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    for seed in (1, 2, 3):
        reply = parse(model="tiny", messages=[{"role": "user", "content": "a pet please"}], response_format=Pet,
                      max_tokens=200, temperature=1.0, seed=seed)
        pet = reply.choices[0].message.parsed
        assert isinstance(pet, Pet) and reply.choices[0].finish_reason == "stop"


def test_json_object_and_forced_tool_call(client):
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "json"}],
                                           response_format={"type": "json_object"}, max_tokens=300, temperature=0)
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    tools = [{"type": "function", "function": {"name": "forecast", "parameters": WEATHER}}]
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}],
                                           tools=tools, tool_choice="required", max_tokens=300, temperature=0)
    calls = reply.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "forecast"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
