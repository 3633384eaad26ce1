"""The router's tokenizer: from --model-path, or fetched once from a worker's GetTokenizer into a cache dir."""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import os
import shutil
import zipfile
from dataclasses import dataclass, field
from typing import Optional

from smg_grpc_proto.generated import common_pb2

from tandem.common.tokenizer import load_tokenizer
from tandem.services.router.chat_template import ChatTemplate

logger = logging.getLogger(__name__)


@dataclass
class TokenizerAssets:
    """A fast tokenizer plus what the router needs from tokenizer_config.json / generation_config.json."""

    tokenizer: object  # tokenizers.Tokenizer
    chat_template: ChatTemplate
    eos_token_ids: list[int] = field(default_factory=list)
    model_max_length: Optional[int] = None
    _token_texts: dict[int, str] = field(default_factory=dict, repr=False)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it encodes (in the router, encode was seen holding it for the whole
        # prompt), so a prompt tokenized on a worker thread leaves the event loop free. Freeing the Encoding
        # holds the GIL: ~0.1 s a MB of prompt, which the character bound limits.
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def bos_token_id(self) -> Optional[int]:
        """The BOS token's id (None when the model names none)."""
        bos = self.chat_template.special["bos_token"]
        return self.tokenizer.token_to_id(bos) if bos else None

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for, so a prompt longer than this times the context
        length cannot fit: refused before it is tokenized. Each token's decoded text, and its vocabulary
        string too (at least as long: one character per byte for byte-level BPE, and it keeps the leading
        space a SentencePiece decode strips); special tokens included, as a prompt may spell them. A normalizer
        that composes characters (NFC) can shrink text a little before tokenizing; real prompts average a few
        characters a token, far below this bound, so that slack never decides whether a prompt fits."""
        tokenizer = self.tokenizer
        decoded = tokenizer.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
        longest_decoded = max((len(text) for text in decoded), default=1)
        longest_piece = max((len(piece) for piece in tokenizer.get_vocab(with_added_tokens=True)), default=1)
        return max(longest_decoded, longest_piece, 1)

    def token_text(self, token_id: int) -> str:
        """One token's text for logprobs (special tokens shown, partial UTF-8 bytes as U+FFFD), memoised."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def load_tokenizer_assets(directory: str, chat_template_file: Optional[str] = None) -> TokenizerAssets:
    """The tokenizer in `directory`; --chat-template's file, when given, replaces the model's template."""
    info = load_tokenizer(directory)
    template = info.chat_template
    if chat_template_file is not None:
        with open(chat_template_file, encoding="utf-8") as f:
            template = f.read()
    assets = TokenizerAssets(info.tokenizer, ChatTemplate(template, info.bos_token, info.eos_token),
                             info.eos_token_ids, info.model_max_length)
    _ = assets.max_token_chars  # computed once here (a pass over the vocabulary), not by the first request
    return assets


async def fetch_tokenizer_dir(stub, cache_dir: str, timeout_s: float = 60.0) -> str:
    """Download a worker's tokenizer bundle (GetTokenizer: zip chunks, sha256 on the last) into cache_dir/<sha256>/."""
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
        if os.path.exists(target):  # another fetch won the race; its copy is the same bundle
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, target)
        logger.info("tokenizer fetched from a worker into %s", target)
    return target
