"""Worker tokens → router text path → OpenAI chat chunks and response, with reasoning and tool calls parsed out;
the worker is replaced by a scripted token stream of real token ids (the built-in tokenizer)."""

from __future__ import annotations

import asyncio
import json

import pytest

from tandem.services.router.generation import TextGenerator
from tandem.services.router.messages import ChatOptions, GenerationSpec, SamplingOptions, TokenDelta, Usage
from tandem.services.router.openai_protocol import ResponseShaper
from tandem.services.router.tokenizer import load_tokenizer_assets

OUTPUT = ('<think>The user wants weather.</think>\nChecking.<tool_call>\n{"name": "get_weather", '
          '"arguments": {"city": "Paris \u00e9t\u00e9"}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


class ScriptedDispatcher:
    """Streams fixed token ids one at a time, as a worker's Generate would."""

    def __init__(self, ids: list[int]):
        self.ids = ids

    async def generate(self, req):
        for i, token in enumerate(self.ids):
            last = i == len(self.ids) - 1
            yield TokenDelta(0, [token], finished=last, finish_reason="stop" if last else None,
                             completion_tokens=len(self.ids) if last else 0)


def run(assets, spec: GenerationSpec, parsers: tuple) -> tuple[list, dict]:
    generator = TextGenerator(lambda: assets, ScriptedDispatcher(assets.encode(OUTPUT, add_special_tokens=False)),
                              lambda: 1024, None, *parsers)
    req = generator.prepare(spec)

    async def collect():
        usage = Usage()
        return [d async for d in generator.stream(spec, req, usage)], usage

    deltas, usage = asyncio.run(collect())
    shaper = ResponseShaper(spec, req.request_id, "tiny")
    return [shaper.chunk(d) for d in deltas], ResponseShaper(spec, req.request_id, "tiny").full({0: deltas}, usage)


@pytest.fixture(scope="module")
def assets(tiny_llama):
    return load_tokenizer_assets(tiny_llama)


def spec_with(tool_choice: str) -> GenerationSpec:
    return GenerationSpec(kind="chat", model="tiny", sampling=SamplingOptions(max_tokens=100),
                          messages=[{"role": "user", "content": "weather?"}],
                          chat=ChatOptions(tools=TOOLS, tool_choice=tool_choice))


def test_reasoning_and_tool_calls_are_parsed_from_token_by_token_output(assets):
    chunks, full = run(assets, spec_with("auto"), ("hermes", "qwen3"))
    message = full["choices"][0]["message"]
    assert message["reasoning_content"] == "The user wants weather."
    assert message["content"] == "\nChecking."
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris \u00e9t\u00e9"}
    assert full["choices"][0]["finish_reason"] == "tool_calls"
    # streamed: the name once, then argument pieces that add up to the same arguments
    pieces = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [p["function"]["name"] for p in pieces if "name" in p["function"]] == ["get_weather"]
    assert len(pieces) > 2 and "".join(p["function"]["arguments"] for p in pieces) == call["function"]["arguments"]
    assert "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks) == "The user wants weather."
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_without_parsers_the_output_is_plain_content(assets):
    _, full = run(assets, spec_with("none"), (None, None))
    assert full["choices"][0]["message"] == {"role": "assistant", "content": OUTPUT}
