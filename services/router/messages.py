"""The router's in-process messages: a validated request, token deltas from workers, text deltas to clients."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from tandem.services.router.sessions import SessionParams, SessionTurn


@dataclass
class SamplingOptions:
    max_tokens: Optional[int] = None  # None: the endpoint's default, bounded by the context length
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: Optional[int] = None
    n: int = 1
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


@dataclass
class GenerationSpec:
    """A validated text-level request (from HTTP or the router's gRPC API)."""

    kind: str  # "completion" | "chat"
    model: Optional[str]  # None: the served model
    sampling: SamplingOptions
    prompt: Optional[str] = None  # completion: text ...
    prompt_ids: Optional[list[int]] = None  # ... or token ids
    messages: Optional[list[dict]] = None  # chat
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: `usage` on every chunk (with include_usage)
    logprobs: Optional[int] = None  # None: no logprobs; k: sampled token's plus top-k alternatives
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs: a choice's `prompt_logprobs` field
    prompt_top_logprobs: int = 0  # vLLM's prompt_logprobs: k, each prompt token's k likeliest alternatives
    user: Optional[str] = None
    echo: bool = False  # completions: the prompt's text is the start of each choice's text
    chat: "ChatOptions" = field(default_factory=lambda: ChatOptions())
    # ("json_schema", schema text), sent as the worker's GenerateRequest sampling_params constraint
    constraint: Optional[tuple[str, str]] = None
    session: Optional["SessionParams"] = None  # SGLang's session_params: the session turn this continues


@dataclass
class ChatOptions:
    """What a chat request asks of the template and of its output's parsing."""

    tools: Optional[list[dict]] = None  # OpenAI tool objects, as the template sees them
    tool_choice: str = "none"  # none | auto | required | function (then tool_name)
    tool_name: Optional[str] = None
    documents: Optional[list[dict]] = None
    template_kwargs: dict = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class PromptLogprobs(list):
    """Each prompt token's logprob (None for the first), as a list; `top` holds each position's top-k alternatives
    (id, logprob) when they were asked for, else []."""

    def __init__(self, values: list[Optional[float]], top: Optional[list[list[tuple[int, float]]]] = None):
        super().__init__(values)
        self.top = top or []


@dataclass
class TokenRequest:
    """What the dispatcher sends to workers: token ids in."""

    request_id: str
    input_ids: list[int]
    sampling: SamplingOptions
    max_new_tokens: int
    top_logprobs: int = 0
    return_logprob: bool = False
    prompt_logprobs: bool = False  # each prompt token's logprob (and, with top_logprobs k, its top k)
    original_text: str = ""
    lora_id: str = ""  # the LoRA adapter the OpenAI `model` named ("" for the base model)
    constraint: Optional[tuple[str, str]] = None  # (oneof field of SamplingParams.constraint, its text)
    session: Optional["SessionTurn"] = None  # a session's turn: its worker keeps the KV pinned


@dataclass
class TokenDelta:
    """New tokens of one sequence (index) from the worker; `finished` on its last delta."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finished: bool = False
    finish_reason: Optional[str] = None  # stop | length | abort
    matched_token_id: Optional[int] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: Optional[list[Optional[float]]] = None
    weight_version: Optional[str] = None  # of the worker that produced it (the router registry's view)


@dataclass
class LogprobEntry:
    token_id: int
    token: str
    logprob: Optional[float]  # None: the first prompt token of an echo (nothing predicts it)
    top: list[tuple[int, str, float]] = field(default_factory=list)


@dataclass
class ToolCallDelta:
    """A piece of one tool call (OpenAI's streaming shape): id and name come first, arguments in pieces."""

    index: int
    id: Optional[str] = None
    name: Optional[str] = None
    arguments: str = ""

    def to_dict(self) -> dict:
        out: dict = {"index": self.index}
        function: dict = {"arguments": self.arguments}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
        if self.name is not None:
            function["name"] = self.name
        out["function"] = function
        return out


@dataclass
class ChoiceDelta:
    """New text of one choice; `finish_reason` set on its last delta. For chat, `text` is the content left
    once reasoning (`reasoning`) and tool calls (`tool_calls`) are parsed out of the model's output."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: Optional[str] = None
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    prompt_tokens: int = 0  # of this choice's prompt
    completion_tokens: int = 0  # this choice's output tokens so far, held-back ones included


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: Optional[list[Optional[float]]] = None
    weight_version: Optional[str] = None  # the serving worker's, known from the first delta on

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens, "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
