"""Tool calls out of chat output: --tool-call-parser hermes (Qwen's <tool_call> JSON) and llama3_json, streamed
as OpenAI tool_call deltas; and the JSON that tool_choice required / a named function constrains the output to."""

from __future__ import annotations

import json
import re
import uuid
from typing import Optional

from tandem.services.router.messages import ToolCallDelta
from tandem.services.router.reasoning import _held_prefix

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_NAME_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_CLOSERS = " \t\r\n}"  # what may follow the arguments object inside a call: held back until the call ends


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _arguments_text(call: dict) -> str:
    arguments = call.get("arguments", call.get("parameters", {}))
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _valid_call(obj) -> bool:
    arguments = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
    return isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(arguments, dict)


class HermesToolParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2.5, Qwen3, Hermes) anywhere in
    the output; the text around them is content. Streaming as vLLM does: the call's id and name as soon as the
    name is complete, then its arguments text as it grows (the last closing braces wait for </tool_call>)."""

    def __init__(self):
        self.buffer = ""
        self.in_call = False
        self.calls = 0
        self.header_sent = False
        self.args_sent = 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.buffer += text
        content, deltas = "", []
        while True:
            if not self.in_call:
                at = self.buffer.find(TOOL_CALL_START)
                if at < 0:
                    keep = _held_prefix(self.buffer, TOOL_CALL_START)
                    content += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return content, deltas
                content += self.buffer[:at]
                self.buffer, self.in_call = self.buffer[at + len(TOOL_CALL_START):], True
                self.header_sent, self.args_sent = False, 0
            end = self.buffer.find(TOOL_CALL_END)
            if end < 0:
                keep = _held_prefix(self.buffer, TOOL_CALL_END)
                deltas += self._partial(self.buffer[:len(self.buffer) - keep])
                return content, deltas
            body, self.buffer, self.in_call = self.buffer[:end], self.buffer[end + len(TOOL_CALL_END):], False
            text_back, done = self._complete(body)
            content += text_back
            deltas += done

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        """The end of the output: an unclosed call counts if its JSON is whole, else it stays text."""
        rest, self.buffer = self.buffer, ""
        if not self.in_call:
            return rest, []
        self.in_call = False
        return self._complete(rest)

    def _partial(self, body: str) -> list[ToolCallDelta]:
        deltas = []
        if not self.header_sent:
            head = _NAME_HEAD.match(body)
            if head is None:
                return []
            deltas.append(ToolCallDelta(self.calls, id=new_call_id(), name=json.loads(f'"{head.group(1)}"')))
            self.header_sent = True
        key = _ARGUMENTS_KEY.search(body)
        if key is not None:
            upto = len(body.rstrip(_CLOSERS))
            start = key.end() + self.args_sent
            if upto > start:
                deltas.append(ToolCallDelta(self.calls, arguments=body[start:upto]))
                self.args_sent += upto - start
        return deltas

    def _complete(self, body: str) -> tuple[str, list[ToolCallDelta]]:
        try:
            call = json.loads(body)
        except ValueError:
            call = None
        valid = _valid_call(call)
        if not valid and not self.header_sent:
            return TOOL_CALL_START + body + TOOL_CALL_END, []  # not a call after all: the text is content
        arguments = self._raw_arguments(body, call if valid else None)
        if self.header_sent:  # announced already (a call whose JSON then broke is finished as written)
            rest = arguments[self.args_sent:]
            deltas = [ToolCallDelta(self.calls, arguments=rest)] if rest else []
        else:
            deltas = [ToolCallDelta(self.calls, id=new_call_id(), name=call["name"], arguments=arguments)]
        self.calls += 1
        self.header_sent, self.args_sent = False, 0
        return "", deltas

    @staticmethod
    def _raw_arguments(body: str, call: Optional[dict]) -> str:
        """The arguments exactly as the model wrote them, so the streamed pieces add up to this text."""
        key = _ARGUMENTS_KEY.search(body)
        if key is None:
            return _arguments_text(call) if call is not None else "{}"
        try:
            _, end = json.JSONDecoder().raw_decode(body, key.end())
            return body[key.end():end]
        except ValueError:
            return body[key.end():].rstrip(_CLOSERS)


class Llama3JsonToolParser:
    """Llama 3.1/3.2 JSON tool calls: an output that is `{"name": ..., "parameters": {...}}` (optionally after
    <|python_tag|>, several separated by ';') is tool calls; any other output is content. A call is only known
    to be one when its JSON is whole, so tool calls arrive at the end of the stream, each in one delta."""

    def __init__(self):
        self.buffer = ""
        self.state = "start"  # start → json (held to the end) | content

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.buffer += text
        if self.state == "start":
            head = self.buffer.lstrip()
            head = head[len(PYTHON_TAG):].lstrip() if head.startswith(PYTHON_TAG) else head
            if head.startswith("{"):
                self.state = "json"
            elif not head or PYTHON_TAG.startswith(head):
                return "", []
            else:
                self.state = "content"
        if self.state == "json":
            return "", []
        out, self.buffer = self.buffer, ""
        return out, []

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        text, self.buffer = self.buffer, ""
        if self.state != "json":
            return text, []
        calls = parse_json_calls(text.strip().removeprefix(PYTHON_TAG))
        if calls is None:
            return text, []
        return "", [ToolCallDelta(i, id=new_call_id(), name=c["name"], arguments=_arguments_text(c))
                    for i, c in enumerate(calls)]


def parse_json_calls(text: str) -> Optional[list[dict]]:
    """JSON call objects one after another (';' or whitespace between), or None if the text is anything else."""
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
        if pos == len(text):
            return calls or None
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        if not _valid_call(obj):
            return None
        calls.append(obj)


class ForcedToolCalls:
    """tool_choice required (the output is constrained to a JSON array of {name, parameters}: the calls come
    whole at the end) or a named function (the output is constrained to its arguments, so they stream as they
    are generated, after a first delta with the call's id and name; an output cut short by max_tokens is
    returned as it is, with finish_reason length saying so)."""

    def __init__(self, tool_name: Optional[str]):
        self.tool_name = tool_name
        self.buffer = ""
        self.started = False

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self.tool_name is None:
            self.buffer += text
            return "", []
        if not text:
            return "", []
        if self.started:
            return "", [ToolCallDelta(0, arguments=text)]
        self.started = True
        return "", [ToolCallDelta(0, id=new_call_id(), name=self.tool_name, arguments=text)]

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        if self.tool_name is not None:
            return "", [] if self.started else [ToolCallDelta(0, id=new_call_id(), name=self.tool_name,
                                                                arguments="{}")]
        text, self.buffer = self.buffer, ""
        try:
            value = json.loads(text)
        except ValueError:
            return text, []  # cut short (finish_reason length): what was generated is returned as it is
        if not isinstance(value, list) or not all(_valid_call(c) for c in value):
            return text, []
        return "", [ToolCallDelta(i, id=new_call_id(), name=c["name"], arguments=_arguments_text(c))
                    for i, c in enumerate(value)]


TOOL_CALL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def required_tools_schema(tools: list[dict]) -> dict:
    """The JSON schema tool_choice "required" constrains the output to: one or more calls of the given tools
    (vLLM's shape: [{"name": ..., "parameters": {...}}])."""
    def one(tool: dict) -> dict:
        function = tool["function"]
        return {"type": "object", "properties": {"name": {"type": "string", "enum": [function["name"]]},
                                                 "parameters": function.get("parameters") or {"type": "object"}},
                "required": ["name", "parameters"]}

    return {"type": "array", "minItems": 1, "items": {"anyOf": [one(t) for t in tools]}}
