"""Chat templates: the model's Jinja template (from tokenizer_config.json) rendered in a sandbox."""

from __future__ import annotations

from datetime import datetime
from typing import Optional

from services.router.errors import ApiError

# Used only when the model ships no template: ChatML, which the built-in models also use.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplate:
    def __init__(self, source: Optional[str], bos_token: Optional[str] = None, eos_token: Optional[str] = None):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise jinja2.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source or CHATML_TEMPLATE
        self.template = env.from_string(self.source)
        self.special = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        self._template_error = jinja2.TemplateError

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special, **extra)
        except self._template_error as e:
            # The template itself rejects the conversation (e.g. roles out of order): the client's to fix.
            raise ApiError(400, f"messages: the model's chat template rejected them: {e}", param="messages") from None
