"""The chat-only parts of a request: messages (tool calls and results included), tools and tool_choice,
response_format, and what goes to the chat template; each failure a 400 naming the field."""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from tandem.services.router.chat_template import RESERVED_KWARGS
from tandem.services.router.errors import bad_request
from tandem.services.router.messages import ChatOptions
from tandem.services.router.tool_parsers import required_tools_schema

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def _text(content: Any, field: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(field, "only text content parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(field, "expected a string or an array of text parts")


def _tool_calls(calls: Any, field: str) -> list[dict]:
    """Assistant tool calls as the template sees them: arguments parsed into an object (as vLLM passes them),
    so templates that write `arguments | tojson` do not quote a string."""
    if not isinstance(calls, list):
        raise bad_request(field, "expected an array of tool calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{field}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{at}.function", "expected an object with a string name and arguments")
        if call.get("type", "function") != "function":
            raise bad_request(f"{at}.type", f"must be \"function\", got {call.get('type')!r}")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError as e:
                raise bad_request(f"{at}.function.arguments", f"is not valid JSON: {e}") from None
        if not isinstance(arguments, dict):
            raise bad_request(f"{at}.function.arguments", "must be a JSON object")
        entry = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def parse_messages(raw: Any) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages", "required: a non-empty array of messages")
    messages = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{i}]", "expected an object")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        entry: dict = {"role": role, "content": _text(message.get("content"), f"messages[{i}].content")}
        for name in ("name", "tool_call_id", "reasoning_content", "reasoning"):
            value = message.get(name)
            if value is not None and not isinstance(value, str):
                raise bad_request(f"messages[{i}].{name}", "expected a string")
            if value is not None:
                entry[name] = value
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise bad_request(f"messages[{i}].tool_calls", "only assistant messages carry tool calls")
            entry["tool_calls"] = _tool_calls(message["tool_calls"], f"messages[{i}].tool_calls")
        messages.append(entry)
    return messages


def parse_tools(raw: Any) -> Optional[list[dict]]:
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise bad_request("tools", "expected an array of tools")
    tools, names = [], set()
    for i, tool in enumerate(raw):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise bad_request(f"tools[{i}]", "expected {\"type\": \"function\", \"function\": {...}}")
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise bad_request(f"tools[{i}].function.name", "must be 1-64 letters, digits, '_', '.' or '-'")
        if name in names:
            raise bad_request(f"tools[{i}].function.name", f"{name!r} is defined twice")
        names.add(name)
        for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
            if function.get(key) is not None and not isinstance(function[key], kind):
                raise bad_request(f"tools[{i}].function.{key}", f"expected {'an object' if kind is dict else kind.__name__}")
        tools.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return tools


def parse_tool_choice(raw: Any, tools: Optional[list[dict]]) -> tuple[str, Optional[str]]:
    if raw is None:
        return ("auto" if tools else "none"), None
    if raw in ("none", "auto", "required"):
        if raw != "none" and not tools:
            raise bad_request("tool_choice", f"{raw!r} needs tools")
        return raw, None
    function = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(function, dict):
        raise bad_request("tool_choice", "expected \"none\", \"auto\", \"required\" or "
                                         "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    name = function.get("name")
    if not tools or name not in {t["function"]["name"] for t in tools}:
        raise bad_request("tool_choice.function.name", f"{name!r} is not one of the tools")
    return "function", name


def response_format_schema(raw: Any) -> Optional[dict]:
    """The JSON schema response_format asks for (json_object: any object), or None for text."""
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise bad_request("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")
    spec = raw.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise bad_request("response_format.json_schema", "expected an object with a name and a schema")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema", "must be a JSON Schema object")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad_request("response_format.json_schema.strict", "expected a boolean")
    return schema  # strict or not, the output is constrained to the schema


def _template_kwargs(raw: Any) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise bad_request("chat_template_kwargs", "expected an object")
    for key in raw:
        if key in RESERVED_KWARGS:
            raise bad_request(f"chat_template_kwargs.{key}", "is set by the request itself, not here")
    return dict(raw)


def parse_chat_options(data: dict, boolean) -> tuple[ChatOptions, Optional[tuple[str, str]]]:
    """ChatOptions and the worker constraint they imply; `boolean(name, default)` reads a boolean field."""
    tools = parse_tools(data.get("tools"))
    tool_choice, tool_name = parse_tool_choice(data.get("tool_choice"), tools)
    if data.get("parallel_tool_calls") is False and tool_choice in ("auto", "required"):
        raise bad_request("parallel_tool_calls", "false is not supported with tool_choice auto or required")
    documents = data.get("documents")
    if documents is not None and (not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents)):
        raise bad_request("documents", "expected an array of objects")
    options = ChatOptions(tools=tools, tool_choice=tool_choice, tool_name=tool_name, documents=documents,
                          template_kwargs=_template_kwargs(data.get("chat_template_kwargs")),
                          add_generation_prompt=boolean("add_generation_prompt", True),
                          continue_final_message=boolean("continue_final_message", False))
    if options.add_generation_prompt and options.continue_final_message and "add_generation_prompt" in data:
        raise bad_request("continue_final_message", "cannot be used with add_generation_prompt true")
    if options.continue_final_message:
        options.add_generation_prompt = False
    schema = response_format_schema(data.get("response_format"))
    if tool_choice == "required":
        forced = required_tools_schema(tools)
    elif tool_choice == "function":
        forced = next(t for t in tools if t["function"]["name"] == tool_name)["function"].get("parameters")
        forced = forced or {"type": "object"}
    else:
        forced = None
    if forced is not None and schema is not None:
        raise bad_request("response_format", f"cannot be combined with tool_choice {tool_choice!r} (both constrain "
                                             "the output)")
    chosen = forced if forced is not None else schema
    return options, (None if chosen is None else ("json_schema", json.dumps(chosen, ensure_ascii=False)))
