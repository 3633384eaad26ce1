"""A model directory's tokenizer, as transformers' AutoTokenizer builds it, and its chat and stop settings."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass, field
from typing import Optional

from tokenizers import Tokenizer

logger = logging.getLogger(__name__)


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
    """The tokenizer in `path` and its chat/stop settings. Encoding and decoding with `.tokenizer` give what
    `AutoTokenizer.from_pretrained(path)` gives (see `build_backend`); a GGUF model's: `hf_tokenizer_dir`."""
    path = hf_tokenizer_dir(path)
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise FileNotFoundError(f"{path!r} has no tokenizer.json (only fast tokenizers are supported)")
    tokenizer = build_backend(path)
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


# The files AutoTokenizer reads to choose and build a tokenizer: a cached build is good while they are unchanged.
_BUILD_INPUTS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json",
                 "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model")
_CACHE_FORMAT = "2"  # changed whenever build_backend builds differently, so no older build is read back


def build_backend(path: str) -> Tokenizer:
    """The `tokenizers.Tokenizer` that `AutoTokenizer.from_pretrained(path)` encodes and decodes with.

    tokenizer.json alone is not enough: transformers 5 picks a tokenizer class by model type (config.json) and
    tokenizer_config.json, and a class such as Qwen2Tokenizer rebuilds the normalizer and pre-tokenizer from its
    own code (it splits digits one by one) and adds the special tokens it defaults to. The object it ends with
    holds all of that, so encoding with it is AutoTokenizer's encode at the `tokenizers` library's speed. Its
    decode is transformers' too, but for clean_up_tokenization_spaces, which transformers skips for BPE.

    Importing transformers costs a process 2-3 s (it imports torch), too much for the router's start-up: the built
    tokenizer is kept under $TANDEM_CACHE_DIR/tokenizers, keyed by the input files and the library versions."""
    cache_path = _cache_path(path)
    if cache_path is not None and os.path.isfile(cache_path):
        return Tokenizer.from_file(cache_path)
    from transformers import AutoTokenizer  # transformers + torch (~2-3 s of import): only when not cached

    tokenizer = AutoTokenizer.from_pretrained(path).backend_tokenizer
    # transformers turns off the truncation and padding a tokenizer.json may carry unless a call asks for them.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    if cache_path is not None:
        try:
            os.makedirs(os.path.dirname(cache_path), exist_ok=True)
            tmp = f"{cache_path}.tmp-{os.getpid()}-{threading.get_ident()}"
            tokenizer.save(tmp, pretty=False)
            os.replace(tmp, cache_path)  # a reader sees a whole file or none
        except OSError as e:  # a read-only home costs the next load the import, nothing else
            logger.warning("could not cache the tokenizer built for %s: %s", path, e)
    return tokenizer


def hf_tokenizer_dir(model_path: str) -> str:
    """`model_path` itself, or for a GGUF model (model.config.gguf_file) a HF tokenizer directory built from the
    file's metadata as `AutoTokenizer.from_pretrained(dir, gguf_file=...)` builds it (tokens, merges, pre-tokenizer,
    bos/eos, add_bos, chat template), saved once under $TANDEM_CACHE_DIR/tokenizers, keyed by the file's path,
    size and modification time and the library versions."""
    from tandem.common.model.config import gguf_file

    gguf = gguf_file(model_path)
    if gguf is None:
        return model_path
    stat = os.stat(gguf)
    digest = _versions_digest()
    if digest is None:
        raise RuntimeError(f"{gguf}: building a GGUF model's tokenizer needs transformers and tokenizers installed")
    digest.update(f"\0gguf\0{os.path.realpath(gguf)}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    target = os.path.join(_cache_root(), "tokenizers", f"gguf-{digest.hexdigest()}")
    if os.path.isfile(os.path.join(target, "tokenizer.json")):
        return target
    from transformers import AutoTokenizer  # parses the GGUF vocabulary: once per file version

    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf) or ".", gguf_file=os.path.basename(gguf))
    tmp = f"{target}.tmp-{os.getpid()}-{threading.get_ident()}"
    tokenizer.save_pretrained(tmp)
    if os.path.isdir(target):  # another process built it first: the same files
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, target)
    logger.info("tokenizer of %s built from its GGUF metadata into %s", gguf, target)
    return target


def _versions_digest():
    try:
        versions = [importlib.metadata.version(name) for name in ("transformers", "tokenizers")]
    except importlib.metadata.PackageNotFoundError:
        return None
    return hashlib.sha256("\0".join([_CACHE_FORMAT, *versions]).encode())


def _cache_root() -> str:
    return os.environ.get("TANDEM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tandem")


def _cache_path(path: str) -> Optional[str]:
    digest = _versions_digest()
    if digest is None:
        return None
    for name in _BUILD_INPUTS:
        file_path = os.path.join(path, name)
        if os.path.isfile(file_path):
            digest.update(f"\0{name}\0".encode())
            with open(file_path, "rb") as f:
                digest.update(f.read())
    return os.path.join(_cache_root(), "tokenizers", f"{digest.hexdigest()}.json")


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(token) -> Optional[str]:
    if isinstance(token, dict):  # AddedToken serialized as {"content": ...}
        return token.get("content")
    return token
