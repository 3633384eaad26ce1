"""xgrammar's TokenizerInfo from the backend AutoTokenizer builds equals `TokenizerInfo.from_huggingface`'s for every
tokenizer shape (byte-level BPE as `tandem model create` writes it for each architecture, byte-fallback BPE,
SentencePiece-like Unigram, word-level, a vocabulary whose encoding the decoder does not say, a class that rebuilds
the backend, tokens only tokenizer_config.json names), transformers itself builds a slow-only one, and the grammar
backend warms up without importing transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tokenizers import Tokenizer

from tandem.common.model.create import ARCHS, build_corpus
from tandem.common.sampling import xgrammar_tokenizer
from tandem.common.sampling.xgrammar_tokenizer import grammar_tokenizer_info, import_xgrammar
from tandem.common.tokenizer import build_backend
from tests.common.rpc.helpers import REPO_ROOT

@pytest.fixture(autouse=True)
def _own_tokenizer_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))


FIELDS = ("vocab_type", "add_prefix_space", "decoded_vocab", "stop_token_ids", "vocab_size", "special_token_ids")


def _write(model_dir: str, tokenizer, config: dict) -> str:
    os.makedirs(model_dir, exist_ok=True)
    if tokenizer is not None:
        tokenizer.save(os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return model_dir


def _byte_fallback(model_dir: str, tokenizer_class: str = "PreTrainedTokenizerFast", decoder: bool = True) -> str:
    """Llama-2's shape: BPE with <0x00>..<0xFF> byte pieces in the vocabulary, "▁" for spaces prepended by the
    normalizer; without `decoder` the decoder does not say ByteFallback (only the vocabulary shows it)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    specials = ["<unk>", "<s>", "</s>"]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = (decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                            decoders.Strip(" ", 1, 0)]) if decoder else decoders.Metaspace())
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials + [f"<0x{b:02X}>" for b in range(256)],
                                  show_progress=False, min_frequency=2)
    tokenizer.train_from_iterator(build_corpus(500), trainer=trainer)
    data = json.loads(tokenizer.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] in specials]  # byte pieces: plain vocab
    return _write(model_dir, Tokenizer.from_str(json.dumps(data)),
                  {"tokenizer_class": tokenizer_class, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


def _unigram(model_dir: str) -> str:
    """SentencePiece-like (T5's shape): Unigram with a Metaspace pre-tokenizer and decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=600, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>",
                                      show_progress=False)
    tokenizer.train_from_iterator(build_corpus(500), trainer=trainer)
    return _write(model_dir, tokenizer, {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>",
                                         "unk_token": "<unk>", "pad_token": "<pad>"})


def _byte_level(model_dir: str, config: dict | None = None) -> str:
    """GPT-2's shape, with a prefix space in the pre-tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(build_corpus(500), trainer=trainer)
    return _write(model_dir, tokenizer,
                  config or {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"})


def _word_level(model_dir: str) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=500, special_tokens=["[UNK]", "[SEP]"], show_progress=False)
    tokenizer.train_from_iterator(build_corpus(300), trainer=trainer)
    return _write(model_dir, tokenizer, {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "[SEP]",
                                         "unk_token": "[UNK]"})


def _config_adds_a_token(model_dir: str) -> str:
    """tokenizer_config.json names a bos token tokenizer.json lacks: transformers appends it to the vocabulary."""
    return _byte_level(model_dir, {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                                   "bos_token": "<|start|>"})


def _slow_only(model_dir: str) -> str:
    """vocab.json + merges.txt and no tokenizer.json: only transformers builds this tokenizer."""
    from tokenizers import Tokenizer

    _byte_level(model_dir)
    Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).model.save(model_dir)
    os.remove(os.path.join(model_dir, "tokenizer.json"))
    return _write(model_dir, None, {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"})


def _llama_class_without_prefix_space(model_dir: str) -> str:
    """LlamaTokenizer with add_prefix_space false: transformers rebuilds the backend without the "▁" prefix that
    tokenizer.json's normalizer still adds."""
    _byte_fallback(model_dir, "LlamaTokenizer")
    with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    return _write(model_dir, None, {**config, "add_prefix_space": False})


# shape -> (builder, whether xgrammar's from_huggingface itself must build it: only a slow-only tokenizer)
SHAPES = {
    "byte_fallback": (_byte_fallback, False),
    "byte_fallback_seen_in_vocab_only": (lambda d: _byte_fallback(d, decoder=False), False),
    "unigram_metaspace": (_unigram, False),
    "byte_level_prefix_space": (_byte_level, False),
    "word_level": (_word_level, False),
    "llama_class": (lambda d: _byte_fallback(d, "LlamaTokenizer"), False),
    "llama_class_without_prefix_space": (_llama_class_without_prefix_space, False),
    "config_adds_a_token": (_config_adds_a_token, False),
    "slow_only": (_slow_only, True),
}


def _reference(model_dir: str, vocab_size, stop_token_ids: list[int]):
    import xgrammar as xgr
    from transformers import AutoTokenizer

    return xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_dir), vocab_size=vocab_size,
                                              stop_token_ids=stop_token_ids)


def _assert_same(model_dir: str, vocab_size, stop_token_ids: list[int]) -> None:
    ours = grammar_tokenizer_info(model_dir, vocab_size, stop_token_ids)
    reference = _reference(model_dir, vocab_size, stop_token_ids)
    for field in FIELDS:
        assert getattr(ours, field) == getattr(reference, field), field


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_the_built_in_tokenizer_gives_from_huggingfaces_info(model_factory, monkeypatch, preset):
    """Read from tokenizer.json alone (transformers is not asked), equal to from_huggingface's."""
    model_dir = model_factory("llama", preset)
    monkeypatch.setattr(xgrammar_tokenizer, "_from_transformers", lambda *a: pytest.fail(f"transformers used: {a}"))
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    import_xgrammar()
    for size in (vocab_size, vocab_size + 64, None):  # the model's, a padded LM head, the tokenizer's own
        _assert_same(model_dir, size, [1, 3])
    info = grammar_tokenizer_info(model_dir, vocab_size, [1])
    assert info.vocab_type.name == "BYTE_LEVEL" and not info.add_prefix_space


@pytest.mark.parametrize("arch", ARCHS)
def test_each_created_architecture_gives_from_huggingfaces_info(model_factory, arch):
    """Qwen2's model type makes AutoTokenizer a Qwen2Tokenizer (its own pre-tokenizer); the others load as written."""
    model_dir = model_factory(arch)
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    import_xgrammar()
    for size in (vocab_size, None):
        _assert_same(model_dir, size, [1, 3])


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_each_tokenizer_shape_gives_from_huggingfaces_info(tmp_path, monkeypatch, shape):
    build, via_transformers = SHAPES[shape]
    model_dir = build(str(tmp_path / shape))
    calls = []
    real = xgrammar_tokenizer._from_transformers
    monkeypatch.setattr(xgrammar_tokenizer, "_from_transformers", lambda *a: calls.append(a) or real(*a))
    for size in (None, 1024):
        _assert_same(model_dir, size, [2])
    assert bool(calls) == via_transformers


def test_the_shapes_read_from_tokenizer_json_cover_every_vocab_type_and_both_prefix_settings(tmp_path):
    """Equality above is worth something only if the shapes differ where it matters."""
    infos = [grammar_tokenizer_info(build(str(tmp_path / name)), None, [2])
             for name, (build, via_transformers) in SHAPES.items() if not via_transformers]
    assert {i.vocab_type.name for i in infos} == {"RAW", "BYTE_FALLBACK", "BYTE_LEVEL"}
    assert {i.add_prefix_space for i in infos} == {True, False}


@pytest.mark.parametrize("shape,field", [("llama_class_without_prefix_space", "add_prefix_space"),
                                         ("config_adds_a_token", "vocab_size")])
def test_tokenizer_json_alone_would_differ_where_autotokenizer_rebuilds_it(tmp_path, monkeypatch, shape, field):
    model_dir = SHAPES[shape][0](str(tmp_path / shape))
    monkeypatch.setattr(xgrammar_tokenizer, "build_backend",
                        lambda d: Tokenizer.from_file(os.path.join(d, "tokenizer.json")))
    alone = grammar_tokenizer_info(model_dir, None, [0])
    assert getattr(alone, field) != getattr(_reference(model_dir, None, [0]), field)


def test_empty_stop_token_ids_are_refused_as_from_huggingface_refuses_them(tiny_llama):
    with pytest.raises(ValueError, match="stop_token_ids cannot be empty"):
        grammar_tokenizer_info(tiny_llama, None, [])
    with pytest.raises(ValueError, match="stop_token_ids cannot be empty"):
        _reference(tiny_llama, None, [])


@pytest.mark.e2e
def test_the_grammar_backend_warms_up_without_transformers(tiny_llama):
    """In a fresh process: the warm-up (xgrammar, the vocabulary, the compiler) leaves transformers unloaded, a JSON
    constraint compiles and ends at the stop token, and transformers imported afterwards is the real one for xgrammar too."""
    script = (
        "import sys; from tandem.common.sampling.grammar import GrammarBackend; "
        "backend = GrammarBackend(sys.argv[1], 512, {1}); backend.warm_up().result(timeout=120); "
        "print('transformers' in sys.modules); "
        "compiled = backend.compile('json_schema', '{\"type\": \"object\"}').result(timeout=60); "
        "matcher = backend.matcher(compiled); print(matcher.accept_string('{}'), matcher.accept_token(1), matcher.is_terminated()); "
        "import transformers, xgrammar; from xgrammar.contrib import hf; "
        "print(issubclass(hf.LogitsProcessor, transformers.LogitsProcessor)); "
        "from transformers import AutoTokenizer; "
        "info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(sys.argv[1]), stop_token_ids=[1]); "
        "print(info.vocab_type.name)")
    build_backend(tiny_llama)  # cached as the router or `tandem generate` would have left it
    proc = subprocess.run([sys.executable, "-c", script, tiny_llama], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True", "True", "True", "True", "BYTE_LEVEL"]
