"""Chat templates render exactly as transformers' apply_chat_template renders them, for the bundled template and
real-world ones (Llama 3.1, Qwen2.5 with tools, Qwen3 with thinking) in tests/services/router/data."""

from __future__ import annotations

import os

import pytest

from tandem.services.router.chat_template import ChatTemplate
from tandem.services.router.errors import ApiError

DATA = os.path.join(os.path.dirname(__file__), "data", "chat_templates")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather <now> & here",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
PLAIN = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b> 中文 & 'x'"}]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
]
THINKING = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Adding."},
            {"role": "user", "content": "and 3+3?"}]


def template_source(name: str, tiny_llama: str) -> str:
    if name == "bundled":
        from tandem.common.tokenizer import load_tokenizer
        return load_tokenizer(tiny_llama).chat_template
    with open(os.path.join(DATA, name)) as f:
        return f.read()


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_llama):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_llama)


CASES = [
    ("bundled", PLAIN, {}), ("bundled", TOOL_TURNS, {"tools": TOOLS}), ("bundled", TOOL_TURNS, {}),
    ("bundled", PLAIN, {"add_generation_prompt": False}),
    ("llama3.jinja", PLAIN, {}), ("llama3.jinja", TOOL_TURNS, {"tools": TOOLS}),
    ("llama3.jinja", PLAIN, {"date_string": "01 Jan 2026"}),
    ("qwen2_5.jinja", PLAIN, {}), ("qwen2_5.jinja", TOOL_TURNS, {"tools": TOOLS}),
    ("qwen3.jinja", THINKING, {}), ("qwen3.jinja", THINKING, {"enable_thinking": False}),
    ("qwen3.jinja", TOOL_TURNS, {"tools": TOOLS}),
    ("generation_dates.jinja", PLAIN + [{"role": "assistant", "content": "ok"}],
     {"documents": [{"title": "a<b", "text": "x & y"}]}),
    ("bundled", PLAIN + [{"role": "assistant", "content": "The answer is"}],
     {"continue_final_message": True, "add_generation_prompt": False}),
    ("qwen2_5.jinja", PLAIN + [{"role": "assistant", "content": "Sure: "}],
     {"continue_final_message": True, "add_generation_prompt": False}),
]


@pytest.mark.parametrize("name,messages,kwargs", CASES)
def test_renders_as_transformers_does(name, messages, kwargs, tiny_llama, hf_tokenizer):
    source = template_source(name, tiny_llama)
    expected = hf_tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False,
                                                add_generation_prompt=kwargs.get("add_generation_prompt", True),
                                                **{k: v for k, v in kwargs.items() if k != "add_generation_prompt"})
    ours = ChatTemplate(source, hf_tokenizer.bos_token, hf_tokenizer.eos_token)
    assert ours.render(messages, **kwargs) == expected


def test_tojson_does_not_html_escape(tiny_llama):
    ours = ChatTemplate(template_source("bundled", tiny_llama), "<s>")
    text = ours.render([{"role": "user", "content": "hi"}], tools=TOOLS)
    assert '"The weather <now> & here"' in text and "\\u003c" not in text


def test_bundled_template_writes_tool_calls_and_results_as_qwen_does(tiny_llama):
    text = ChatTemplate(template_source("bundled", tiny_llama)).render(TOOL_TURNS, tools=TOOLS)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>" in text


def test_raise_exception_is_400_naming_messages():
    ours = ChatTemplate(template_source("generation_dates.jinja", ""))
    with pytest.raises(ApiError) as info:
        ours.render([{"role": "assistant", "content": "x"}])
    assert info.value.status == 400 and info.value.param == "messages"
    assert "must start with a system or user message" in info.value.message


def test_continue_final_message_needs_text_to_continue():
    with pytest.raises(ApiError) as info:
        ChatTemplate(None).render([{"role": "assistant", "content": None}], continue_final_message=True)
    assert info.value.param == "continue_final_message"


def test_a_template_that_does_not_compile_is_a_clear_error():
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}")
