"""Request validation: every bad input gets its status and a message naming the field."""

from __future__ import annotations

import pytest

from tandem.services.router.errors import ApiError
from tandem.services.router.openai_protocol import MAX_JSON_DEPTH, parse_chat, parse_completion, parse_json_body

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
    ({"logit_bias": {"5": 500}}, "logit_bias"), ({"logprobs": 50}, "logprobs"), ({"prompt_logprobs": 50}, "prompt_logprobs"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"), ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"usage_every": True}}, "stream_options.usage_every"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": "yes"}},
     "stream_options.continuous_usage_stats"),
    ({"stream": True, "stream_options": []}, "stream_options"), ({"suffix": "x"}, "suffix"),
    ({"prompt": 5}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, VOCAB]}, "prompt"), ({"model": ""}, "model"), ({"model": 3}, "model"),
    ({"temperature": 10**400}, "temperature"), ({"top_k": 2**31}, "top_k"),
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
    ({"max_completion_tokens": -1}, "max_completion_tokens"), ({"tools": [{"type": "function"}]}, "tools[0]"), ({"frobnicate": 1}, "frobnicate"),
])
def test_bad_chat_parameters_are_400_naming_the_field(extra, field):
    error = error_of(parse_chat, {**OK_CHAT, **extra})
    assert error.status == 400 and error.param == field, error.message


def test_body_must_be_an_object():
    assert error_of(parse_completion, [1, 2]).status == 400


@pytest.mark.parametrize("options,include,continuous", [
    ({"include_usage": True, "continuous_usage_stats": True}, True, True),  # guidellm's
    ({"include_usage": True}, True, False), ({"include_usage": True, "continuous_usage_stats": False}, True, False),
    ({"continuous_usage_stats": True}, False, False),  # vLLM: per-chunk usage only along with the final one
    ({"include_usage": None, "continuous_usage_stats": None}, False, False), ({}, False, False),
])
def test_stream_options_follow_vllm(options, include, continuous):
    for parse, body in ((parse_completion, OK_COMPLETION), (parse_chat, {"messages": [{"role": "user", "content": "x"}]})):
        spec = parse({**body, "stream": True, "stream_options": options}, VOCAB)
        assert (spec.include_usage, spec.continuous_usage) == (include, continuous)


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


# ---- the JSON body: Unicode, finiteness, depth (parse_json_body runs before the parsers above) --------------

def body_error(raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_json_body(raw)
    return info.value


@pytest.mark.parametrize("raw,field", [
    (rb'{"model": "m", "prompt": "a\ud800b"}', "prompt"),
    (rb'{"model": "m", "messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "\udfff"}]}',
     "messages[1].content"),
    (rb'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]}',
     "messages[0].content[0].text"),
    (rb'{"model": "m", "prompt": "x", "stop": ["fine", "\udc00"]}', "stop[1]"),
    (rb'{"model": "m", "prompt": "x", "temperature": NaN}', "temperature"),
    (rb'{"model": "m", "prompt": "x", "top_p": Infinity}', "top_p"),
    (rb'{"model": "m", "prompt": "x", "presence_penalty": -Infinity}', "presence_penalty"),
    (rb'{"model": "m", "prompt": "x", "frequency_penalty": 1e999}', "frequency_penalty"),
    (rb'{"model": "m", "prompt": "x", "logit_bias": {"5": NaN}}', "logit_bias.5"),
    (rb'{"model": "m", "prompt": "x", "seed": Infinity}', "seed"),
    (rb'{"model": "m", "prompt": "x", "min_p": NaN}', "min_p"),
])
def test_body_strings_must_be_unicode_and_numbers_finite(raw, field):
    error = body_error(raw)
    assert error.status == 400 and error.param == field and error.message.startswith(field), error.message


def test_a_surrogate_pair_is_one_valid_character():
    assert parse_json_body(rb'{"prompt": "\ud83d\ude00"}') == {"prompt": "\U0001F600"}


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1000, 100_000])
def test_deep_nesting_is_400_at_any_depth(depth):
    raw = b'{"model": "m", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    error = body_error(raw)
    assert error.status == 400 and "nested deeper" in error.message


def test_nesting_up_to_the_bound_parses():
    depth = MAX_JSON_DEPTH - 1  # the object itself is one level
    assert parse_json_body(b'{"x": ' + b"[" * depth + b"]" * depth + b"}")


def test_not_json_and_huge_integers_are_400():
    assert body_error(b"{not json").status == 400
    assert body_error(b'{"seed": ' + b"9" * 5000 + b"}").status == 400  # int() refuses > 4300 digits
    assert body_error(b'{"prompt": "\xff"}').status == 400


@pytest.mark.parametrize("key", ["\u00b2", "\u0661", "-1", " 5", "5 ", "+5", "0x5", "1" * 40, ""])
def test_logit_bias_keys_must_be_ascii_decimal_token_ids(key):
    error = error_of(parse_completion, {**OK_COMPLETION, "logit_bias": {key: 1}})
    assert error.status == 400 and error.param == "logit_bias", error.message


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                                  "repetition_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_sampling_numbers_are_400(name, value):
    """The gRPC API builds its body from floats, which may be NaN or Infinity (no JSON parsing on that path)."""
    error = error_of(parse_completion, {**OK_COMPLETION, name: value})
    assert error.status == 400 and error.param == name, error.message
    error = error_of(parse_completion, {**OK_COMPLETION, "logit_bias": {"3": value}})
    assert error.param == "logit_bias"
