"""Chat templates rendered as transformers' apply_chat_template renders them, without importing transformers."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Optional

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tandem.services.router.errors import ApiError

# Used only when the model ships no template: ChatML, which the built-in models also use.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# HF appends this to the final message, renders, and cuts the text there (continue_final_message).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Names the router passes itself: chat_template_kwargs may not override them.
RESERVED_KWARGS = ("messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token")


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` (HF's assistant-mask marker): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; HF's (and so every template's author) does not.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


class _Namespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore attributes (HF's sandbox rule: no reaching CPython internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 - Jinja's own signature trick, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _Namespace
    return env


def _alias_reasoning(message: dict) -> dict:
    """HF fills `reasoning_content` (and `thinking`) from whichever reasoning name the client used."""
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class ChatTemplate:
    def __init__(self, source: Optional[str], bos_token: Optional[str] = None, eos_token: Optional[str] = None):
        self.source = source or CHATML_TEMPLATE
        try:
            self.template = make_environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template does not compile: {e} (line {e.lineno})") from None
        self.special = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: Optional[list] = None,
               documents: Optional[list] = None, continue_final_message: bool = False, **kwargs) -> str:
        """The prompt text, as HF's apply_chat_template(tokenize=False) writes it for the same arguments.
        A template that refuses the conversation (raise_exception) is a 400 naming messages."""
        chat = [_alias_reasoning(dict(m)) for m in messages]
        final = ""
        if continue_final_message:
            final = self._tag_final(chat)
        try:
            text = self.template.render(messages=chat, tools=tools, documents=documents,
                                        add_generation_prompt=add_generation_prompt,
                                        **{**kwargs, **self.special})
        except jinja2.TemplateError as e:
            # The template itself rejects the conversation (e.g. roles out of order): the client's to fix.
            raise ApiError(400, f"messages: the model's chat template rejected them: {e}", param="messages") from None
        except (TypeError, ValueError, AttributeError, KeyError) as e:  # a template tripping over odd input
            raise ApiError(400, f"messages: the model's chat template failed on them: {e}", param="messages") from None
        return self._cut_at_tag(text, final) if continue_final_message else text

    def _tag_final(self, chat: list[dict]) -> str:
        if not chat or not isinstance(chat[-1].get("content"), str):
            raise ApiError(400, "continue_final_message: the final message has no text content to continue",
                           param="continue_final_message")
        final = chat[-1]["content"]
        chat[-1]["content"] = final + _CONTINUE_TAG
        return final

    def _cut_at_tag(self, text: str, final: str) -> str:
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ApiError(400, "continue_final_message: the model's chat template drops part of the final "
                                "message, so it cannot be continued", param="continue_final_message")
        at = text.rindex(tag)
        if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return text[:at]
        return text[:at].rstrip()  # the template trimmed the message's trailing space; so does HF
