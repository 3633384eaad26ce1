"""Request validation: every bad input gets its status and a message naming the field."""

from __future__ import annotations

import pytest

from services.router.errors import ApiError
from services.router.openai_protocol import parse_chat, parse_completion

VOCAB = 512
OK_COMPLETION = {"model": "m", "prompt": "hi"}
OK_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def error_of(parse, body) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body, VOCAB)
    return info.value


@pytest.mark.parametrize("extra,field", [
    ({"temperature": 2.5}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"),
    ({"min_p": -0.1}, "min_p"), ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": "10"}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"n": 0}, "n"), ({"n": 1000}, "n"), ({"seed": 1.5}, "seed"), ({"stop": 5}, "stop"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"), ({"logprobs": 50}, "logprobs"), ({"echo": True}, "echo"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"), ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"suffix": "x"}, "suffix"),
    ({"prompt": 5}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, VOCAB]}, "prompt"), ({"model": ""}, "model"), ({"model": 3}, "model"),
])
def test_bad_completion_parameters_are_400_naming_the_field(extra, field):
    error = error_of(parse_completion, {**OK_COMPLETION, **extra})
    assert error.status == 400
    assert error.param == field and error.message.startswith(field), error.message


@pytest.mark.parametrize("extra,field", [
    ({"messages": []}, "messages"), ({"messages": "hi"}, "messages"), ({"messages": [5]}, "messages[0]"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"top_logprobs": 3}, "top_logprobs"), ({"logprobs": 1}, "logprobs"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"), ({"tools": [{"type": "function"}]}, "tools"),
])
def test_bad_chat_parameters_are_400_naming_the_field(extra, field):
    error = error_of(parse_chat, {**OK_CHAT, **extra})
    assert error.status == 400 and error.param == field, error.message


def test_body_must_be_an_object():
    assert error_of(parse_completion, [1, 2]).status == 400


def test_valid_requests_parse_into_the_internal_spec():
    spec = parse_completion({**OK_COMPLETION, "max_tokens": 7, "temperature": 0, "stop": "x", "seed": 3, "n": 2,
                             "logprobs": 2, "stream": True, "stream_options": {"include_usage": True},
                             "logit_bias": {"5": -100}, "top_k": 0}, VOCAB)
    s = spec.sampling
    assert (s.max_tokens, s.temperature, s.stop, s.seed, s.n, s.top_k) == (7, 0.0, ["x"], 3, 2, -1)
    assert spec.logprobs == 2 and spec.stream and spec.include_usage and s.logit_bias == {5: -100.0}
    chat = parse_chat({**OK_CHAT, "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 9,
                       "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]}]}, VOCAB)
    assert chat.logprobs == 3 and chat.sampling.max_tokens == 9 and chat.messages[0]["content"] == "ab"
    assert parse_completion({**OK_COMPLETION, "prompt": [[1, 2, 3]]}, VOCAB).prompt_ids == [1, 2, 3]
