"""A model directory's fast tokenizer and what its config files say about chat formatting and stopping.

Torch-free: the router loads tokenizers with it as well as the workers."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

from tokenizers import Tokenizer


@dataclass
class TokenizerInfo:
    """A model's tokenizer plus what tokenizer_config.json says about chat formatting."""

    tokenizer: Tokenizer
    chat_template: Optional[str] = None
    bos_token: Optional[str] = None
    eos_token: Optional[str] = None
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    # Every id that ends generation: tokenizer_config's eos plus config/generation_config's.
    eos_token_ids: list[int] = field(default_factory=list)
    model_max_length: Optional[int] = None  # tokenizer_config's, when it is a real limit


def load_tokenizer(path: str) -> TokenizerInfo:
    tok_path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise FileNotFoundError(f"{path!r} has no tokenizer.json (only fast tokenizers are supported)")
    tokenizer = Tokenizer.from_file(tok_path)
    cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_path = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            template = f.read()
    bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
    max_len = cfg.get("model_max_length")  # HF writes ~1e30 for "no limit"
    info = TokenizerInfo(tokenizer, template, bos, eos,
                         tokenizer.token_to_id(bos) if bos else None,
                         tokenizer.token_to_id(eos) if eos else None,
                         model_max_length=int(max_len) if isinstance(max_len, (int, float)) and max_len < 1e9 else None)
    if info.eos_token_id is not None:
        info.eos_token_ids.append(info.eos_token_id)
    for name in ("config.json", "generation_config.json"):
        value = _read_json(os.path.join(path, name)).get("eos_token_id")
        for eos_id in value if isinstance(value, list) else [value] if isinstance(value, int) else []:
            if eos_id not in info.eos_token_ids:
                info.eos_token_ids.append(eos_id)
    return info


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(token) -> Optional[str]:
    if isinstance(token, dict):  # AddedToken serialized as {"content": ...}
        return token.get("content")
    return token
