"""xgrammar imported, and its TokenizerInfo built from the tokenizer AutoTokenizer builds, without transformers.

`xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(...))` costs a worker (and every rank that loads
the grammar backend) seconds of CPU in transformers alone; the same TokenizerInfo comes from the backend
`tokenizers.Tokenizer` that common/tokenizer.py's `build_backend` builds once with transformers and caches;
tests/common/sampling/test_xgrammar_tokenizer.py holds the two equal, field by field, for each tokenizer shape."""

from __future__ import annotations

import logging
import os
import sys
import threading
import types
from typing import Optional

from tokenizers import Tokenizer

from tandem.common.tokenizer import build_backend

logger = logging.getLogger(__name__)

_xgrammar: Optional[types.ModuleType] = None
_xgrammar_lock = threading.Lock()


class _TransformersClass(type):
    """Stands for the transformers class of the same name in xgrammar's isinstance checks; transformers is imported
    when one runs, which only `TokenizerInfo.from_huggingface` does (given a transformers tokenizer, so already
    imported)."""

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, _transformers_class(cls.__name__))

    def __subclasscheck__(cls, subclass) -> bool:
        return issubclass(subclass, _transformers_class(cls.__name__))


def _transformers_class(name: str) -> type:
    import transformers  # transformers (~1 s): only an isinstance check on a transformers object gets here

    return getattr(transformers, name)


def import_xgrammar() -> types.ModuleType:
    """The xgrammar module. xgrammar 0.2.x imports transformers at its own import for two isinstance checks in
    `TokenizerInfo.from_huggingface` and for `xgrammar.contrib.hf` (a transformers LogitsProcessor): about a second
    of CPU, in every process that constrains decoding. While xgrammar is imported a stand-in answers for
    transformers; it is removed right after, so a later `import transformers` gets the real one. Another thread's
    first `import transformers` during those tenths of a second would get the stand-in: no serving process imports
    transformers but through `_from_transformers`, which runs after this import on the same thread."""
    global _xgrammar
    if _xgrammar is not None:
        return _xgrammar
    with _xgrammar_lock:
        if _xgrammar is None:
            _xgrammar = _import_without_transformers()
        return _xgrammar


def _import_without_transformers() -> types.ModuleType:
    if "xgrammar" in sys.modules or "transformers" in sys.modules:  # nothing left to save
        import xgrammar  # xgrammar (~2 s): only a process that builds the grammar backend, on first use

        return xgrammar
    stand_in = types.ModuleType("transformers")
    for name in ("PreTrainedTokenizerBase", "PreTrainedTokenizerFast"):
        setattr(stand_in, name, _TransformersClass(name, (), {}))
    stand_in.LogitsProcessor = type("LogitsProcessor", (), {})
    sys.modules["transformers"] = stand_in
    try:
        import xgrammar  # the same, with transformers stood in for (see import_xgrammar)
    finally:
        if sys.modules.get("transformers") is stand_in:
            del sys.modules["transformers"]
        # xgrammar.contrib.hf subclassed the stand-in's LogitsProcessor: forget that module, so that
        # `import xgrammar.contrib.hf` loads it again over the real transformers (and `xgr.hf` is gone, not wrong).
        contrib = sys.modules.pop("xgrammar.contrib.hf", None)
        for parent in ("xgrammar", "xgrammar.contrib"):
            if contrib is not None and getattr(sys.modules.get(parent), "hf", None) is contrib:
                delattr(sys.modules[parent], "hf")
    return xgrammar


def grammar_tokenizer_info(model_path: str, vocab_size: Optional[int], stop_token_ids: list[int]):
    """The `xgr.TokenizerInfo` that `from_huggingface(AutoTokenizer.from_pretrained(model_path), vocab_size=...,
    stop_token_ids=...)` builds, read from the backend tokenizer AutoTokenizer builds (`build_backend`: cached, so
    transformers is imported only on a model's first load); a slow-only tokenizer goes to transformers itself."""
    xgr = import_xgrammar()
    if not stop_token_ids:  # from_huggingface's own check: xgrammar would otherwise guess the stop tokens
        raise ValueError("stop_token_ids cannot be empty")
    if not os.path.isfile(os.path.join(model_path, "tokenizer.json")):
        return _from_transformers(xgr, model_path, vocab_size, stop_token_ids, "the directory has no tokenizer.json")
    tokenizer = build_backend(model_path)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    # Some tokenizers have no token 0, 1, ...: the largest id, not the count, bounds the vocabulary.
    size = vocab_size or max(len(vocab), max(vocab.values()) + 1)
    encoded_vocab = [""] * size  # ids past the tokenizer's (a padded LM head) stay empty: never allowed
    for token, token_id in vocab.items():
        if token_id < size:
            encoded_vocab[token_id] = token
    vocab_type, add_prefix_space = _vocab_metadata(xgr, tokenizer, vocab)
    return xgr.TokenizerInfo(encoded_vocab, vocab_type, vocab_size=size, stop_token_ids=list(stop_token_ids),
                             add_prefix_space=add_prefix_space)


def _vocab_metadata(xgr, tokenizer: Tokenizer, vocab: dict[str, int]) -> tuple[object, bool]:
    """(vocab type, add_prefix_space) as from_huggingface decides them: from the serialized tokenizer (decoder,
    normalizer, pre-tokenizer), unless the vocabulary itself says another encoding; then add_prefix_space is what
    encoding "a" shows."""
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.to_str())
    from_vocab = xgr.TokenizerInfo._detect_vocab_type_from_vocab(vocab)
    if from_vocab is None or from_vocab == metadata["vocab_type"]:
        return metadata["vocab_type"], metadata["add_prefix_space"]
    tokens = [tokenizer.id_to_token(i) for i in tokenizer.encode("a", add_special_tokens=False).ids]
    prefix = "▁" if from_vocab == xgr.VocabType.BYTE_FALLBACK else "Ġ"
    return from_vocab, bool(tokens and tokens[0] and tokens[0].startswith(prefix))


def _from_transformers(xgr, model_path: str, vocab_size: Optional[int], stop_token_ids: list[int], why: str):
    logger.info("grammar backend: loading %s's tokenizer with transformers: %s", model_path, why)
    from transformers import AutoTokenizer  # transformers (~1 s): only a slow-only tokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
