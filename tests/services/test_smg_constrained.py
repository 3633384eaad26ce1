"""The real SGLang model gateway (`smg`, with its tool-call parser) in front of Tandem's prefill and decode workers:
smg turns response_format json_schema and forced tool calls into the workers' `constraint`, and the random tiny
model's output comes back valid by construction."""

from __future__ import annotations

import json
import os
import shutil

import jsonschema
import pytest

from tests.common.rpc.helpers import http_post, smg_gateway
from tests.services.pd_helpers import PDPair

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(shutil.which("smg") is None,
                                                  reason="the smg gateway (pip install smg) is not installed")]

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
           "required": ["city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def gateway(tiny_llama, tmp_path_factory):
    pair = PDPair(tiny_llama, "--constrained-json-disable-any-whitespace")
    try:
        workers = ["--pd-disaggregation", "--prefill", f"grpc://{pair.prefill.address}",
                   str(pair.prefill.bootstrap_port), "--decode", f"grpc://{pair.decode.address}"]
        with smg_gateway(workers, tiny_llama, tmp_path_factory.mktemp("smg-gram"), 2,
                         "--tool-call-parser", "qwen") as base:
            yield base, pair
    finally:
        pair.close()


def test_json_schema_response_format_through_smg(gateway, tiny_llama):
    base, pair = gateway
    body = {"model": os.path.basename(tiny_llama), "messages": [{"role": "user", "content": "a person"}],
            "max_tokens": 200, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                       "strict": True}}}
    out = json.loads(http_post(f"{base}/v1/chat/completions", body))
    jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), PERSON)
    pair.wait_both_free()


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "forecast"}}])
def test_forced_tool_call_through_smg(gateway, tiny_llama, tool_choice):
    base, pair = gateway
    tools = [{"type": "function", "function": {"name": "forecast", "description": "weather",
                                               "parameters": WEATHER}}]
    body = {"model": os.path.basename(tiny_llama), "messages": [{"role": "user", "content": "weather?"}],
            "max_tokens": 200, "temperature": 0, "tools": tools, "tool_choice": tool_choice}
    out = json.loads(http_post(f"{base}/v1/chat/completions", body))
    calls = out["choices"][0]["message"]["tool_calls"]
    assert calls and calls[0]["function"]["name"] == "forecast", out
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), WEATHER)
    pair.wait_both_free()
