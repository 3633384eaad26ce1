"""One chat choice's output split into reasoning, content and tool calls as it streams (reasoning first, then
tool calls out of what is left), by the parsers the router was started with and the request's tool_choice."""

from __future__ import annotations

from typing import Optional

from tandem.services.router.errors import bad_request
from tandem.services.router.messages import ChatOptions, ChoiceDelta
from tandem.services.router.reasoning import ReasoningParser
from tandem.services.router.tool_parsers import TOOL_CALL_PARSERS, ForcedToolCalls


def check_tool_choice(options: ChatOptions, tool_call_parser: Optional[str]) -> None:
    """tool_choice auto needs --tool-call-parser: without it the calls could not be told from text."""
    if options.tools and options.tool_choice == "auto" and tool_call_parser is None:
        raise bad_request("tool_choice", "\"auto\" needs the router started with --tool-call-parser (hermes or "
                                         "llama3_json); use \"required\", a named function, or \"none\"")


class ChatOutputParser:
    def __init__(self, options: ChatOptions, tool_call_parser: Optional[str], reasoning_parser: Optional[str]):
        self.reasoning = ReasoningParser(reasoning_parser) if reasoning_parser else None
        self.tools = None
        if options.tools and options.tool_choice in ("required", "function"):
            self.tools = ForcedToolCalls(options.tool_name if options.tool_choice == "function" else None)
        elif options.tools and options.tool_choice == "auto":
            self.tools = TOOL_CALL_PARSERS[tool_call_parser]()
        self.named = options.tool_choice == "function"
        self.called = False

    def apply(self, out: ChoiceDelta, finished: bool) -> None:
        """Rewrite `out` (its text is the model's raw output so far) into reasoning, content and tool calls."""
        reasoning, content = (self.reasoning.feed(out.text) if self.reasoning is not None else ("", out.text))
        if finished and self.reasoning is not None:
            tail_reasoning, tail_content = self.reasoning.flush()
            reasoning, content = reasoning + tail_reasoning, content + tail_content
        calls = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if finished:
                tail, more = self.tools.flush()
                content, calls = content + tail, calls + more
        self.called = self.called or bool(calls)
        out.text, out.reasoning, out.tool_calls = content, reasoning, calls
        if finished and self.called and out.finish_reason == "stop" and not self.named:
            out.finish_reason = "tool_calls"  # as OpenAI says when the model chose to call (not when forced)
