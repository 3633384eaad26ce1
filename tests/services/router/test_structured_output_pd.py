"""Structured output and forced tool calls through the router on a prefill/decode pair: the prefill samples the
first token under the grammar, the decode continues it; outputs are valid and both workers end empty."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.services.pd_helpers import PDPair
from tests.services.router.conftest import RouterProcess, readiness, wait_until
from tests.services.router.test_structured_output import ASK, TIME, WEATHER, Forecast, check_calls

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pair(tiny_llama):
    pd = PDPair(tiny_llama, "--constrained-json-disable-any-whitespace")
    yield pd
    pd.close()


@pytest.fixture(scope="module")
def client(pair, tiny_llama):
    router = RouterProcess("--prefill", f"grpc://{pair.prefill.address},{pair.prefill.bootstrap_port}",
                           "--decode", f"grpc://{pair.decode.address}", "--model-path", tiny_llama,
                           "--served-model-name", "tiny")
    wait_until(lambda: readiness(router) == 200, 60, "router readiness")
    with openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c
    assert router.stop() == 0


def test_constrained_outputs_on_a_pd_pair_are_valid_and_leave_both_workers_empty(client, pair):
    reply = client.beta.chat.completions.parse(model="tiny", messages=ASK, response_format=Forecast,
                                               max_completion_tokens=200, seed=11, n=2)
    for choice in reply.choices:
        assert isinstance(choice.message.parsed, Forecast), choice.message.content
        jsonschema.validate(json.loads(choice.message.content), Forecast.model_json_schema())
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                           max_completion_tokens=300, seed=12)
    assert reply.choices[0].finish_reason == "tool_calls"
    check_calls(reply.choices[0].message.tool_calls)
    pair.wait_both_free()
