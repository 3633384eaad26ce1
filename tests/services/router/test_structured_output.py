"""Structured output and forced tool calls end to end (official openai client, real router and worker with
xgrammar): the built-in model is random, so valid output proves the constraint, not the model."""

from __future__ import annotations

import json
import re
import sys
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tandem.common.launcher.children import free_port
from tests.services.router.conftest import start_worker

pytestmark = pytest.mark.e2e

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"}, "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Forecast(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    sunny: bool
    # A pattern, not just a length: xgrammar's JSON strings admit raw control characters (U+0000-U+001F but
    # \r and \n), which strict JSON parsers (json.loads, pydantic) refuse.
    note: str = Field(pattern=r"^[a-z ]{0,10}$")


@pytest.fixture(scope="module")
def worker(tiny_llama):
    """The conftest's worker (and through it its router), but with no free whitespace in JSON: a random model
    could otherwise spend every token on spaces."""
    proc = start_worker(tiny_llama, free_port(), "--constrained-json-disable-any-whitespace")
    yield proc
    proc.stop()


def test_parse_with_a_pydantic_model_gives_a_valid_object(client):
    for seed in (1, 2):
        reply = client.beta.chat.completions.parse(model="tiny", messages=ASK, response_format=Forecast,
                                                   max_completion_tokens=200, seed=seed)
        message = reply.choices[0].message
        assert isinstance(message.parsed, Forecast), message.content
        jsonschema.validate(json.loads(message.content), Forecast.model_json_schema())


def test_json_object_is_an_object(client):
    reply = client.chat.completions.create(model="tiny", messages=ASK, max_completion_tokens=300, seed=3,
                                           response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # an object may be longer than the budget; whatever came is a valid prefix of one
        assert reply.choices[0].message.content.startswith("{")


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.id and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_required_gives_valid_calls_of_the_given_tools(client):
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                           max_completion_tokens=300, seed=4)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    check_calls(choice.message.tool_calls)


def test_a_named_function_is_called_streaming_or_not(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=named,
                                           max_completion_tokens=200, seed=5)
    calls = reply.choices[0].message.tool_calls
    check_calls(calls)
    assert [c.function.name for c in calls] == ["get_weather"] and reply.choices[0].finish_reason == "stop"
    arguments, names = "", []
    for chunk in client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=named,
                                                max_completion_tokens=200, seed=5, stream=True):
        for piece in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            names += [piece.function.name] if piece.function.name else []
            arguments += piece.function.arguments or ""
    assert names == ["get_weather"] and arguments == calls[0].function.arguments


def test_an_invalid_schema_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=ASK, max_completion_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "a": {"type": "no-such-type"}}}}})
    assert "json_schema" in info.value.message or "schema" in info.value.message


def test_the_api_docs_openai_example_runs_as_written(router):
    import os
    import subprocess

    from tests.services.router.conftest import REPO_ROOT

    with open(os.path.join(REPO_ROOT, "docs", "api.md")) as f:
        readme = f.read()
    section = readme[readme.index("With the official `openai` client"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TANDEM_URL": router.url}, cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    forecast, call = out.stdout.splitlines()
    assert re.fullmatch(r"city='(Paris|Rome|Oslo)' sunny=(True|False) note='[a-z ]{0,10}'", forecast), forecast
    assert call.startswith("Function(arguments='{\"city\": ") and "name='get_weather'" in call, call


def test_constrained_requests_leave_nothing_on_the_worker(router, worker_address):
    from tandem.common.bench.chaos import leaked

    assert leaked(int(worker_address.rsplit(":", 1)[1])) == {"requests": 0, "kv_tokens": 0}
