"""Chat requests: tools, tool_choice and response_format map onto the worker's json_schema constraint; tool
calls and tool results in the history reach the template; template options are validated."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tandem.services.router.errors import ApiError
from tandem.services.router.openai_protocol import parse_chat, parse_completions

VOCAB = 512
USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def chat(**extra):
    return parse_chat({"messages": USER, **extra}, VOCAB)


def error(**extra) -> ApiError:
    with pytest.raises(ApiError) as info:
        chat(**extra)
    return info.value


def test_model_is_optional_and_tools_default_to_auto():
    spec = chat(tools=[WEATHER])
    assert spec.model is None and spec.chat.tool_choice == "auto" and spec.constraint is None


def test_json_object_and_json_schema_constrain_the_output():
    assert chat(response_format={"type": "json_object"}).constraint == ("json_schema", '{"type": "object"}')
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert spec.constraint[0] == "json_schema" and json.loads(spec.constraint[1]) == schema
    assert chat(response_format={"type": "text"}).constraint is None
    completion = parse_completions({"prompt": "x", "response_format": {"type": "json_object"}}, VOCAB)[0]
    assert completion.constraint == ("json_schema", '{"type": "object"}')


def test_a_named_function_constrains_the_output_to_its_parameters():
    spec = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert spec.chat.tool_choice == "function" and spec.chat.tool_name == "get_weather"
    assert json.loads(spec.constraint[1]) == WEATHER["function"]["parameters"]


def test_required_constrains_the_output_to_an_array_of_calls_of_the_given_tools():
    schema = json.loads(chat(tools=[WEATHER, TIME], tool_choice="required").constraint[1])
    validator = jsonschema.Draft202012Validator(schema)
    validator.validate([{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}])
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "get_weather", "parameters": {}}], {"name": "x"}):
        assert not validator.is_valid(bad), bad


@pytest.mark.parametrize("extra,field", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"), ({"documents": ["x"]}, "documents"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
])
def test_bad_chat_options_are_400_naming_the_field(extra, field):
    e = error(**extra)
    assert e.status == 400 and e.param == field, e.message


def test_tool_calls_and_tool_results_are_kept_for_the_template():
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21C"}]
    spec = parse_chat({"messages": messages, "tools": [WEATHER], "chat_template_kwargs": {"enable_thinking": False},
                       "continue_final_message": False}, VOCAB)
    assert spec.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert spec.messages[2] == {"role": "tool", "content": "21C", "tool_call_id": "c1"}
    assert spec.chat.template_kwargs == {"enable_thinking": False}


def test_continue_final_message_turns_off_the_generation_prompt():
    spec = chat(messages=USER + [{"role": "assistant", "content": "It is"}], continue_final_message=True)
    assert spec.chat.continue_final_message and not spec.chat.add_generation_prompt


def test_a_list_of_prompts_is_one_spec_each_and_echo_include_stop_are_read():
    specs = parse_completions({"prompt": ["a", [1, 2]], "echo": True, "include_stop_str_in_output": True}, VOCAB)
    assert [(s.prompt, s.prompt_ids) for s in specs] == [("a", None), (None, [1, 2])]
    assert all(s.echo and s.sampling.include_stop_str_in_output for s in specs)
