"""OpenAI request validation (JSON body → GenerationSpec, errors naming the field) and response shapes."""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any, Optional

from tandem.common.sampling.params import MAX_TOP_LOGPROBS, token_id_key
from tandem.services.router.chat_request import parse_chat_options, parse_messages, response_format_schema
from tandem.services.router.errors import ApiError, bad_request
from tandem.services.router.messages import ChoiceDelta, GenerationSpec, LogprobEntry, SamplingOptions, Usage
from tandem.services.router.sessions import parse_session_params

MAX_N = 64
MAX_PROMPTS = 64  # completions: prompts in one request (each is its own generation of n choices)
MAX_STOP_STRINGS = 16
MAX_SEED = 2**53  # seeds travel as a protobuf Struct number (a double)
MAX_INT32 = 2**31 - 1
# Fields we cannot honour: accepting them silently would return something the client did not ask for.
UNSUPPORTED = {
    "functions": "the deprecated functions field is not supported; use tools",
    "function_call": "the deprecated function_call field is not supported; use tool_choice",
    "suffix": "suffix (insertion) is not supported",
    "audio": "audio output is not supported", "prediction": "predicted outputs are not supported",
}
SAMPLING_FIELDS = {"max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                   "presence_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "logit_bias",
                   "seed", "n", "best_of", "skip_special_tokens", "include_stop_str_in_output"}
COMMON_FIELDS = {"model", "stream", "stream_options", "user", "response_format", "prompt_logprobs", "session_params",
                 *SAMPLING_FIELDS, *UNSUPPORTED}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "logprobs"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                               "parallel_tool_calls", "chat_template_kwargs", "add_generation_prompt",
                               "continue_final_message", "documents"}
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")  # the second is vLLM's
MAX_JSON_DEPTH = 64  # the deepest legitimate body (a chat message's content parts) is 5 levels
_NOT_SET = object()
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads keeps unpaired "\\ud800" escapes as they are


# ---- the JSON body ------------------------------------------------------------------------------------

class JsonConstant(float):
    """NaN, Infinity or -Infinity as written in a body: Python's json accepts them, JSON (RFC 8259) does not.
    Parsed into this marker so that check_json_values can refuse them naming the field."""

    def __new__(cls, literal: str) -> "JsonConstant":
        value = super().__new__(cls, literal)
        value.literal = literal
        return value


def parse_json_body(raw: bytes) -> Any:
    """The request body as JSON, refused with 400 unless it is valid UTF-8 JSON of bounded depth whose strings
    are valid Unicode and numbers finite. O(body) work: callers run it off the event loop."""
    try:
        data = json.loads(raw, parse_constant=JsonConstant)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # the C parser gives up near sys.getrecursionlimit() levels
        raise ApiError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    check_json_values(data)
    return data


def check_json_values(data: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """400 naming the field (e.g. messages[0].content) of a lone UTF-16 surrogate in a string or key, a
    non-finite number (NaN, Infinity, or 1e999, which overflows to inf), or container nested deeper than
    max_depth. Iterative, so no depth can exhaust the stack."""
    stack: list[tuple[Any, str, int]] = [(data, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if _LONE_SURROGATE.search(value):
                raise bad_request(path or "body", "contains a lone UTF-16 surrogate (e.g. \\ud800 without its pair), "
                                                  "which is not valid Unicode")
        elif isinstance(value, float):
            if not math.isfinite(value):
                shown = value.literal if isinstance(value, JsonConstant) else "a number beyond the double range"
                raise bad_request(path or "body", f"must be a finite number; got {shown}, which JSON does not allow")
        elif isinstance(value, (dict, list)):
            if depth > max_depth:
                raise ApiError(400, f"{path + ': ' if path else ''}the request body is nested deeper than "
                                    f"{max_depth} levels", param=path or None)
            if isinstance(value, dict):
                for key, item in value.items():
                    name = f"{path}.{key}" if path else key
                    if _LONE_SURROGATE.search(key):
                        raise bad_request(path or "body", f"the key {key!r} contains a lone UTF-16 surrogate")
                    stack.append((item, name, depth + 1))
            else:
                stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)
                             if not isinstance(item, int))  # token id arrays: nothing to check in an int


class Body:
    """Typed access to a JSON object's fields; every failure is a 400 naming the field."""

    def __init__(self, data: Any):
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        self.data = data

    def get(self, name: str, kinds: tuple, default=None, what: str = ""):
        value = self.data.get(name, _NOT_SET)
        if value is _NOT_SET or value is None:
            return default
        if isinstance(value, bool) and bool not in kinds:
            raise bad_request(name, f"expected {what or _kind_names(kinds)}, got a boolean")
        if not isinstance(value, kinds):
            raise bad_request(name, f"expected {what or _kind_names(kinds)}, got {type(value).__name__}")
        return value

    def number(self, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
        try:
            value = float(self.get(name, (int, float), default, "a number"))
        except OverflowError:  # an integer of hundreds of digits
            raise bad_request(name, "must be a finite number, got an integer beyond the double range") from None
        if not math.isfinite(value):  # NaN compares false with both bounds; the gRPC API's floats can be inf
            raise bad_request(name, f"must be a finite number, got {value}")
        if value < low or value > high or (low_open and value == low):
            bracket = "(" if low_open else "["
            raise bad_request(name, f"must be in {bracket}{low:g}, {high:g}], got {value:g}")
        return value

    def integer(self, name: str, default: Optional[int], low: int, high: Optional[int] = None) -> Optional[int]:
        value = self.get(name, (int,), default, "an integer")
        if value is not None and (value < low or (high is not None and value > high)):
            span = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise bad_request(name, f"must be {span}, got {value}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        return self.get(name, (bool,), default, "a boolean")


def _kind_names(kinds: tuple) -> str:
    names = {int: "an integer", float: "a number", str: "a string", list: "an array", dict: "an object",
             bool: "a boolean"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _stop_strings(body: Body) -> list[str]:
    stop = body.get("stop", (str, list), [])
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    for s in stops:
        if not isinstance(s, str) or not s:
            raise bad_request("stop", "every stop sequence must be a non-empty string")
    return list(stops)


def _token_id_list(body: Body, name: str, vocab_size: int) -> list[int]:
    ids = body.get(name, (list,), [])
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise bad_request(name, f"every entry must be a token id in [0, {vocab_size}), got {t!r}")
    return list(ids)


def _logit_bias(body: Body, vocab_size: int) -> dict[int, float]:
    bias = body.get("logit_bias", (dict,), {})
    out: dict[int, float] = {}
    for key, value in bias.items():
        token_id = token_id_key(str(key))
        if token_id is None or not token_id < vocab_size:
            raise bad_request("logit_bias", f"keys must be token ids (ASCII digits) in [0, {vocab_size}), got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request("logit_bias", f"values must be numbers in [-100, 100], got {value!r} for {key}")
        out[token_id] = float(value)
    return out


def _sampling(body: Body, vocab_size: int, max_tokens_field: str, min_max_tokens: int = 1) -> SamplingOptions:
    max_tokens = body.integer(max_tokens_field, None, min_max_tokens)
    if max_tokens_field == "max_completion_tokens" and max_tokens is None:
        max_tokens = body.integer("max_tokens", None, 1)
    top_k = body.integer("top_k", -1, -1, MAX_INT32)  # an int32 on the worker API
    seed = body.integer("seed", None, -MAX_SEED, MAX_SEED)
    sampling = SamplingOptions(
        max_tokens=max_tokens, min_tokens=body.integer("min_tokens", 0, 0),
        temperature=body.number("temperature", 1.0, 0.0, 2.0), top_p=body.number("top_p", 1.0, 0.0, 1.0, True),
        top_k=-1 if top_k == 0 else top_k, min_p=body.number("min_p", 0.0, 0.0, 1.0),
        frequency_penalty=body.number("frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=body.number("presence_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=body.number("repetition_penalty", 1.0, 0.0, 2.0, True),
        stop=_stop_strings(body), stop_token_ids=_token_id_list(body, "stop_token_ids", vocab_size),
        ignore_eos=body.boolean("ignore_eos", False), logit_bias=_logit_bias(body, vocab_size),
        seed=seed, n=body.integer("n", 1, 1, MAX_N),
        skip_special_tokens=body.boolean("skip_special_tokens", True),
        include_stop_str_in_output=body.boolean("include_stop_str_in_output", False))
    if max_tokens is not None and sampling.min_tokens > max_tokens:
        raise bad_request("min_tokens", f"must be <= max_tokens ({max_tokens}), got {sampling.min_tokens}")
    best_of = body.integer("best_of", None, 1)
    if best_of is not None and best_of != sampling.n:
        raise bad_request("best_of", "best_of other than n is not supported")
    return sampling


def _common(body: Body) -> tuple[bool, bool, bool, Optional[str]]:
    """(stream, include_usage, continuous_usage, user)."""
    for name, why in UNSUPPORTED.items():
        value = body.data.get(name)
        if value not in (None, [], {}, ""):
            raise bad_request(name, why)
    stream = body.boolean("stream", False)
    include_usage, continuous_usage = _stream_options(body, stream)
    user = body.get("user", (str,), None)
    return stream, include_usage, continuous_usage, user


def _stream_options(body: Body, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage). vLLM's continuous_usage_stats puts `usage` on every chunk, but only
    together with include_usage (its should_include_usage): alone it is accepted and changes nothing."""
    options = body.get("stream_options", (dict,), None)
    if options is None:
        return False, False
    if not stream:
        raise bad_request("stream_options", "only allowed when stream is true")
    flags = {}
    for key, value in options.items():
        field = f"stream_options.{key}"
        if key not in STREAM_OPTIONS:
            raise bad_request(field, f"unknown field (known: {', '.join(STREAM_OPTIONS)})")
        if value is not None and not isinstance(value, bool):  # null is the default, as for top-level fields
            raise bad_request(field, f"expected a boolean, got {type(value).__name__}")
        flags[key] = bool(value)
    include_usage = flags.get("include_usage", False)
    return include_usage, include_usage and flags.get("continuous_usage_stats", False)


def _model(body: Body) -> Optional[str]:
    """Optional (vLLM and SGLang default it to the served model); an empty name is a mistake, not a default."""
    model = body.get("model", (str,), None)
    if model == "":
        raise bad_request("model", "must name the served model (or be left out), got an empty string")
    return model


def _known_fields(body: Body, known: set[str], endpoint: str) -> None:
    for name in body.data:
        if name not in known:
            raise bad_request(name, f"unknown field for {endpoint}")


def _prompt_logprobs(body: Body) -> Optional[int]:
    """vLLM's prompt_logprobs: k, each prompt token's own logprob plus its k likeliest alternatives."""
    return body.integer("prompt_logprobs", None, 0, MAX_TOP_LOGPROBS)


def _prompts(body: Body, vocab_size: int) -> list[tuple[Optional[str], Optional[list[int]]]]:
    """(text, token ids) of each prompt: a string, token ids, or an array of either."""
    prompt = body.data.get("prompt")

    def one(value, field: str) -> tuple[Optional[str], Optional[list[int]]]:
        if isinstance(value, str):
            return value, None
        if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            if not all(0 <= t < vocab_size for t in value):
                raise bad_request(field, f"token ids must be in [0, {vocab_size})")
            return None, list(value)
        raise bad_request(field, "required: a string or a non-empty array of token ids")

    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise bad_request("prompt", f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}")
        return [one(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    try:
        return [one(prompt, "prompt")]
    except ApiError:
        raise bad_request("prompt", "required: a string, a non-empty array of token ids, or an array of "
                                    "either") from None


def parse_completions(data: Any, vocab_size: int) -> list[GenerationSpec]:
    """One spec per prompt (a request may carry several); every other field is shared."""
    body = Body(data)
    _known_fields(body, COMPLETION_FIELDS, "/v1/completions")
    model = _model(body)
    stream, include_usage, continuous_usage, user = _common(body)
    echo = body.boolean("echo", False)
    logprobs = body.integer("logprobs", None, 0, MAX_TOP_LOGPROBS)
    prompt_logprobs = _prompt_logprobs(body)
    constraint = _response_format_constraint(body)
    sampling = _sampling(body, vocab_size, "max_tokens", min_max_tokens=0)
    session = parse_session_params(body.data)
    if sampling.max_tokens == 0 and not echo:
        # vLLM's rule: 0 means "score the prompt" (echo without generation); alone it would return nothing.
        raise bad_request("max_tokens", "0 (score the prompt, generate nothing) needs echo: true")
    prompts = _prompts(body, vocab_size)
    if session is not None and len(prompts) != 1:
        raise bad_request("prompt", "a session turn has one prompt")
    return [GenerationSpec(kind="completion", model=model, sampling=sampling, prompt=text, prompt_ids=ids,
                           stream=stream, include_usage=include_usage, continuous_usage=continuous_usage,
                           logprobs=logprobs, user=user, echo=echo, prompt_logprobs=prompt_logprobs is not None,
                           prompt_top_logprobs=prompt_logprobs or 0,
                           constraint=constraint, session=session)
            for text, ids in prompts]


def parse_completion(data: Any, vocab_size: int) -> GenerationSpec:
    """A completion of exactly one prompt (the gRPC API's Generate)."""
    specs = parse_completions(data, vocab_size)
    if len(specs) != 1:
        raise bad_request("prompt", "one prompt per request here")
    return specs[0]


def _response_format_constraint(body: Body) -> Optional[tuple[str, str]]:
    schema = response_format_schema(body.data.get("response_format"))
    return None if schema is None else ("json_schema", json.dumps(schema, ensure_ascii=False))


def parse_chat(data: Any, vocab_size: int) -> GenerationSpec:
    body = Body(data)
    _known_fields(body, CHAT_FIELDS, "/v1/chat/completions")
    model = _model(body)
    stream, include_usage, continuous_usage, user = _common(body)
    messages = parse_messages(body.get("messages", (list,), None))
    options, constraint = parse_chat_options(body.data, body.boolean)
    want_logprobs = body.boolean("logprobs", False)
    top = body.integer("top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not want_logprobs:
        raise bad_request("top_logprobs", "requires logprobs to be true")
    prompt_logprobs = _prompt_logprobs(body)
    return GenerationSpec(kind="chat", model=model, sampling=_sampling(body, vocab_size, "max_completion_tokens"),
                          messages=messages, stream=stream, include_usage=include_usage,
                          continuous_usage=continuous_usage,
                          logprobs=(top or 0) if want_logprobs else None, user=user, chat=options,
                          constraint=constraint, prompt_logprobs=prompt_logprobs is not None,
                          prompt_top_logprobs=prompt_logprobs or 0, session=parse_session_params(body.data))


# ---- responses ----------------------------------------------------------------------------------------

def completion_logprobs(entries: list[LogprobEntry], text_offset: int) -> dict:
    tokens, offsets, offset = [], [], text_offset
    for e in entries:
        tokens.append(e.token)
        offsets.append(offset)
        offset += len(e.token)
    # OpenAI's (and vLLM's) top_logprobs hold the sampled token too, even when it is not among the top k; an
    # echoed first prompt token has neither a logprob nor alternatives (null in both lists).
    tops = [None if e.logprob is None else {**{t: lp for _, t, lp in e.top}, e.token: e.logprob} if e.top else {}
            for e in entries]
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(entries: list[LogprobEntry]) -> dict:
    def item(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for _, t, lp in e.top]}
                        for e in entries]}


def prompt_logprobs_entries(ids: list[int], values: Optional[list], token_text, k: int = 0) -> Optional[list]:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else {token id: {logprob, rank,
    decoded_token}} for the token itself and its k likeliest alternatives (rank: 1 for the likeliest)."""
    if values is None:
        return None
    tops = getattr(values, "top", None) or [[] for _ in values]

    def entry(token_id: int, logprob: float, rank: Optional[int]) -> dict:
        out: dict = {"logprob": logprob, "decoded_token": token_text(token_id)}
        if rank is not None:
            out["rank"] = rank
        return out

    rows = []
    for t, lp, top in zip(ids, values, tops):
        if lp is None:
            rows.append(None)
            continue
        row = {str(alt): entry(alt, v, rank) for rank, (alt, v) in enumerate(top[:k], 1)}
        if str(t) not in row:  # the prompt token itself: its rank is unknown outside the top k
            row[str(t)] = entry(t, lp, None)
        rows.append(row)
    return rows


def merge_tool_calls(deltas: list[ChoiceDelta]) -> list[dict]:
    calls: dict[int, dict] = {}
    for d in deltas:
        for piece in d.tool_calls:
            call = calls.setdefault(piece.index, {"id": None, "type": "function",
                                                  "function": {"name": None, "arguments": ""}})
            if piece.id is not None:
                call["id"], call["function"]["name"] = piece.id, piece.name
            call["function"]["arguments"] += piece.arguments
    return [calls[i] for i in sorted(calls)]


class ResponseShaper:
    """Builds one request's OpenAI response objects (chunks or the whole response)."""

    def __init__(self, spec: GenerationSpec, request_id: str, model: str,
                 prompt_logprobs: Optional[dict[int, list]] = None):
        self.spec = spec
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.chat = spec.kind == "chat"
        self.text_offsets: dict[int, int] = {}
        self.prompt_logprobs = prompt_logprobs  # choice index → its prompt's entries, sent once per choice

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, delta: ChoiceDelta) -> Optional[dict]:
        if self.spec.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(delta.logprobs)
        offset = self.text_offsets.get(delta.index, 0)
        self.text_offsets[delta.index] = offset + sum(len(e.token) for e in delta.logprobs)
        return completion_logprobs(delta.logprobs, offset)

    def role_chunk(self, index: int, prompt_tokens: int = 0) -> dict:
        chunk = self._head("chat.completion.chunk")
        chunk["choices"] = [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]
        return self._with_usage_field(chunk, prompt_tokens, 0)

    def chunk(self, delta: ChoiceDelta) -> dict:
        if self.chat:
            chunk = self._head("chat.completion.chunk")
            body = {"content": delta.text} if delta.text or (delta.finish_reason is None and not
                                                             (delta.reasoning or delta.tool_calls)) else {}
            if delta.reasoning:
                body["reasoning_content"] = delta.reasoning
            if delta.tool_calls:
                body["tool_calls"] = [t.to_dict() for t in delta.tool_calls]
            choice = {"index": delta.index, "delta": body}
        else:
            chunk = self._head("text_completion")
            choice = {"index": delta.index, "text": delta.text}
        choice["logprobs"] = self._logprobs(delta)
        choice["finish_reason"] = delta.finish_reason
        self._attach_prompt_logprobs(choice, delta.index)
        chunk["choices"] = [choice]
        return self._with_usage_field(chunk, delta.prompt_tokens, delta.completion_tokens)

    def _attach_prompt_logprobs(self, choice: dict, index: int) -> None:
        if self.prompt_logprobs is not None and index in self.prompt_logprobs:
            choice["prompt_logprobs"] = self.prompt_logprobs.pop(index)

    def _with_usage_field(self, chunk: dict, prompt_tokens: int, completion_tokens: int) -> dict:
        """OpenAI's null usage on every chunk before the usage chunk; with vLLM's continuous_usage_stats, the
        chunk's prompt and its choice's tokens so far (not the sum over choices: that is the final chunk's)."""
        if self.spec.continuous_usage:
            chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                              "total_tokens": prompt_tokens + completion_tokens}
        elif self.spec.include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, usage: Usage) -> dict:
        chunk = self._head("chat.completion.chunk" if self.chat else "text_completion")
        chunk["choices"] = []
        chunk["usage"] = usage.to_dict()
        return chunk

    def full(self, choices: dict[int, list[ChoiceDelta]], usage: Usage) -> dict:
        response = self._head("chat.completion" if self.chat else "text_completion")
        out = []
        for index in sorted(choices):
            deltas = choices[index]
            text = "".join(d.text for d in deltas)
            merged = ChoiceDelta(index, text, logprobs=[e for d in deltas for e in d.logprobs])
            finish = next((d.finish_reason for d in reversed(deltas) if d.finish_reason), None)
            self.text_offsets.pop(index, None)
            if self.chat:
                choice = {"index": index, "message": self._message(deltas, text),
                          "logprobs": self._logprobs(merged), "finish_reason": finish}
            else:
                choice = {"index": index, "text": text, "logprobs": self._logprobs(merged), "finish_reason": finish}
            if not self.chat:
                self._attach_prompt_logprobs(choice, index)
            out.append(choice)
        if self.chat and self.prompt_logprobs is not None:  # vLLM puts a chat's (one prompt) at the top level
            response["prompt_logprobs"] = self.prompt_logprobs.get(0)
        response["choices"] = out
        response["usage"] = usage.to_dict()
        return response

    @staticmethod
    def _message(deltas: list[ChoiceDelta], text: str) -> dict:
        message: dict = {"role": "assistant", "content": text}
        reasoning = "".join(d.reasoning for d in deltas)
        if reasoning:
            message["reasoning_content"] = reasoning
        calls = merge_tool_calls(deltas)
        if calls:
            message["tool_calls"] = calls
            if not text.strip():
                message["content"] = None  # OpenAI's shape for a reply that is only tool calls
        return message
