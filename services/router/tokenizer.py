"""The router's tokenizer: from --model-path, or fetched once from a worker's GetTokenizer into a cache dir."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import zipfile
from dataclasses import dataclass, field
from typing import Optional

from services.router.chat_template import ChatTemplate

logger = logging.getLogger(__name__)


@dataclass
class TokenizerAssets:
    """A fast tokenizer plus what the router needs from tokenizer_config.json / generation_config.json."""

    tokenizer: object  # tokenizers.Tokenizer
    chat_template: ChatTemplate
    eos_token_ids: list[int] = field(default_factory=list)
    model_max_length: Optional[int] = None
    directory: str = ""

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def token_text(self, token_id: int) -> str:
        """One token's text for logprobs (special tokens shown, partial UTF-8 bytes as U+FFFD)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _token_text(token) -> Optional[str]:
    return token.get("content") if isinstance(token, dict) else token


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_tokenizer_assets(directory: str) -> TokenizerAssets:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    cfg = _read_json(os.path.join(directory, "tokenizer_config.json"))
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            template = f.read()
    bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
    eos_ids: list[int] = []
    if eos and tokenizer.token_to_id(eos) is not None:
        eos_ids.append(tokenizer.token_to_id(eos))
    for name in ("generation_config.json", "config.json"):
        value = _read_json(os.path.join(directory, name)).get("eos_token_id")
        for eos_id in value if isinstance(value, list) else [value] if isinstance(value, int) else []:
            if eos_id not in eos_ids:
                eos_ids.append(eos_id)
    max_len = cfg.get("model_max_length")
    return TokenizerAssets(tokenizer, ChatTemplate(template, bos, eos), eos_ids,
                           int(max_len) if isinstance(max_len, (int, float)) and max_len < 1e9 else None, directory)


async def fetch_tokenizer_dir(stub, cache_dir: str, timeout_s: float = 60.0) -> str:
    """Download a worker's tokenizer bundle (GetTokenizer: zip chunks, sha256 on the last) into cache_dir/<sha256>/."""
    from smg_grpc_proto.generated import common_pb2

    data, digest = bytearray(), ""
    async for chunk in stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=timeout_s):
        data += chunk.data
        digest = chunk.sha256 or digest
    actual = hashlib.sha256(data).hexdigest()
    if digest and digest != actual:
        raise ValueError(f"tokenizer bundle checksum mismatch: worker says {digest}, got {actual}")
    target = os.path.join(cache_dir, actual)
    if not os.path.isfile(os.path.join(target, "tokenizer.json")):
        tmp = f"{target}.tmp-{os.getpid()}"
        os.makedirs(tmp, exist_ok=True)
        with zipfile.ZipFile(io.BytesIO(bytes(data))) as zf:
            for name in zf.namelist():
                if "/" in name or name.startswith("."):  # flat bundle only; nothing may escape the directory
                    raise ValueError(f"unexpected path {name!r} in the tokenizer bundle")
            zf.extractall(tmp)
        os.replace(tmp, target) if not os.path.exists(target) else None
        logger.info("tokenizer fetched from a worker into %s", target)
    return target
