"""Tool-call and reasoning parsers: the same result however the output is split into stream deltas."""

from __future__ import annotations

import json

import pytest

from tandem.services.router.chat_output import ChatOutputParser
from tandem.services.router.messages import ChatOptions, ChoiceDelta
from tandem.services.router.reasoning import split_reasoning
from tandem.services.router.tool_parsers import ForcedToolCalls, HermesToolParser, Llama3JsonToolParser

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "deep": {"x": [1, '
          '"}"]}}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]


def run(parser, text: str, step: int):
    content, calls = "", {}

    def take(piece):
        nonlocal content
        content += piece[0]
        for d in piece[1]:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": "", "headers": 0})
            if d.id is not None:
                call["id"], call["name"], call["headers"] = d.id, d.name, call["headers"] + 1
            call["arguments"] += d.arguments

    for i in range(0, len(text), step):
        take(parser.feed(text[i:i + step]))
    take(parser.flush())
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("step", [1, 2, 5, 13, 10_000])
def test_hermes_streams_the_same_calls_at_any_split(step):
    content, calls = run(HermesToolParser(), HERMES, step)
    assert content.strip() == "Let me check."
    assert [(c["name"], json.loads(c["arguments"]), c["headers"]) for c in calls] == [
        ("get_weather", {"city": "Paris", "deep": {"x": [1, "}"]}}, 1), ("get_time", {}, 1)]
    assert all(c["id"].startswith("call_") for c in calls)


def test_hermes_streams_arguments_before_the_call_ends():
    parser = HermesToolParser()
    _, first = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert first[0].name == "get_weather" and "".join(d.arguments for d in first) == '{"city": "Par'


def test_hermes_text_that_is_not_a_call_stays_content():
    text = "a <tool_call>not json</tool_call> b <tool"
    assert run(HermesToolParser(), text, 3) == (text, [])


@pytest.mark.parametrize("step", [1, 4, 10_000])
def test_llama3_json_calls(step):
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "t", "parameters": {}}'
    content, calls = run(Llama3JsonToolParser(), text, step)
    assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("t", {})]
    assert run(Llama3JsonToolParser(), "Hello {there}", step) == ("Hello {there}", [])
    assert run(Llama3JsonToolParser(), '{"broken": ', step) == ('{"broken": ', [])


def test_forced_calls():
    _, calls = run(ForcedToolCalls(None), '[{"name": "a", "parameters": {"x": 1}}]', 3)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("a", {"x": 1})]
    parser = ForcedToolCalls("get_weather")
    _, first = parser.feed('{"ci')
    assert [(d.name, d.arguments) for d in first] == [("get_weather", '{"ci')]  # streamed as generated
    _, calls = run(ForcedToolCalls("get_weather"), '{"city": "Paris"}', 3)
    assert [(c["name"], c["arguments"], c["headers"]) for c in calls] == [("get_weather", '{"city": "Paris"}', 1)]
    assert run(ForcedToolCalls(None), '[{"cut', 2) == ('[{"cut', [])  # cut short by max_tokens: text back


@pytest.mark.parametrize("kind,text,expected", [
    ("qwen3", "<think>\nstep\n</think>\n\nAnswer", ("\nstep\n", "\n\nAnswer")),
    ("qwen3", "Answer only", ("", "Answer only")),
    ("qwen3", "<think>never closed", ("never closed", "")),
    ("deepseek_r1", "step</think>Answer", ("step", "Answer")),
    ("deepseek_r1", "<think>step</think>Answer", ("step", "Answer")),
    ("deepseek_r1", "all reasoning", ("all reasoning", "")),
])
def test_reasoning_split(kind, text, expected):
    assert split_reasoning(kind, text) == expected


@pytest.mark.parametrize("step", [1, 3, 10_000])
def test_reasoning_then_tool_calls_stream_into_deltas(step):
    text = "<think>weather?</think>\n" + HERMES
    parser = ChatOutputParser(ChatOptions(tools=TOOLS, tool_choice="auto"), "hermes", "qwen3")
    reasoning, content, calls, finish = "", "", [], None
    for i in range(0, len(text), step):
        last = i + step >= len(text)
        delta = ChoiceDelta(0, text[i:i + step], finish_reason="stop" if last else None)
        parser.apply(delta, last)
        reasoning, content, calls, finish = reasoning + delta.reasoning, content + delta.text, calls + delta.tool_calls, delta.finish_reason
    assert reasoning == "weather?" and content.strip() == "Let me check." and finish == "tool_calls"
    assert [c.name for c in calls if c.id] == ["get_weather", "get_time"]
