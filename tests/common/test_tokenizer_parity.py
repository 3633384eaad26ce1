"""Tandem's tokenizer (router, `tandem generate`, /tokenize, chat) encodes and decodes as AutoTokenizer does."""

from __future__ import annotations

import pytest

from tandem.common.model.create import ARCHS
from tandem.common.tokenizer import load_tokenizer
from tandem.services.router.tokenizer import load_tokenizer_assets

TRICKY = [
    "1, 2, 3, 4,",
    "12345678901234567890 and 3.14159, -42",
    "   leading spaces, trailing   ",
    "a    run\t\ttabs\n\nnewlines\r\n  \n\t mixed",
    "中文 你好世界 日本語 東京 한국어",
    "emoji 🙂🚀 👍🏽 🌍✨ and a flag 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n\nprint(f'{f(3)=}')",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|begin_of_text|>text<|end_of_text|> <|pad|>",
    "café naïve Zürich e\u0301 \u212b",  # composed and decomposed accents: a normalizer shows here
    "",
]
MESSAGES = [
    {"role": "system", "content": "Be brief. 1, 2, 3."},
    {"role": "user", "content": "Count: 10, 20,  30\t40 — 中文 🙂"},
    {"role": "assistant", "content": "<tool_call> 1 2 3"},
    {"role": "user", "content": "again\n\n  please"},
]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, model_factory, tmp_path_factory):
    """(model dir, Tandem's TokenizerInfo, transformers' AutoTokenizer) for one architecture's created model; the
    TokenizerInfo is the cached build, read back without transformers (see test_a_cached_build_skips_transformers)."""
    from transformers import AutoTokenizer

    path = model_factory(request.param)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        load_tokenizer(path)  # builds with transformers and caches
        mp.setattr(AutoTokenizer, "from_pretrained", _no_transformers)
        info = load_tokenizer(path)
    return path, info, AutoTokenizer.from_pretrained(path)


def _no_transformers(*args, **kwargs):
    raise AssertionError("a cached tokenizer was built again with transformers")


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_and_decode_match_autotokenizer(pair, add_special_tokens):
    path, info, hf = pair
    assets = load_tokenizer_assets(path)
    for text in TRICKY:
        want = hf.encode(text, add_special_tokens=add_special_tokens)
        assert info.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids == want, text
        assert assets.encode(text, add_special_tokens=add_special_tokens) == want, text
        for skip in (True, False):
            assert info.tokenizer.decode(want, skip_special_tokens=skip) == hf.decode(want, skip_special_tokens=skip)


def test_digits_split_as_the_model_type_says(pair):
    """The issue's example: Qwen2Tokenizer splits digits one by one, so '1, 2,' differs from tokenizer.json's."""
    _, info, hf = pair
    assert info.tokenizer.encode("1, 2, 3, 4,").ids == hf.encode("1, 2, 3, 4,")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_tokens_match_apply_chat_template(pair, add_generation_prompt):
    path, _, hf = pair
    assets = load_tokenizer_assets(path)
    text = assets.chat_template.render(MESSAGES, add_generation_prompt=add_generation_prompt)
    want = hf.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=True,
                                  return_dict=False)
    assert text == hf.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert assets.encode(text, add_special_tokens=False) == list(want)


def test_special_token_ids_are_autotokenizers(pair):
    _, info, hf = pair
    assert (info.bos_token_id, info.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    assert info.tokenizer.get_vocab_size(with_added_tokens=True) == len(hf)


def test_a_cached_build_skips_transformers(model_factory, tmp_path, monkeypatch):
    """The first load builds with AutoTokenizer and caches; the next reads the cache; a changed input file (here
    tokenizer_config.json) is another key, built again."""
    import shutil

    from transformers import AutoTokenizer

    path = str(tmp_path / "model")
    shutil.copytree(model_factory("qwen2"), path)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    built = load_tokenizer(path).tokenizer
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 1
    with monkeypatch.context() as mp:
        mp.setattr(AutoTokenizer, "from_pretrained", _no_transformers)
        assert load_tokenizer(path).tokenizer.to_str() == built.to_str()
    with open(f"{path}/tokenizer_config.json", "a", encoding="utf-8") as f:
        f.write("\n")
    load_tokenizer(path)
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 2


def test_created_tokenizer_files_are_what_the_model_type_builds(pair):
    """`tandem model create` writes each arch's own tokenizer class (Qwen2Tokenizer for the Qwen types, as their
    checkpoints do) and a tokenizer.json that encodes as that class does, with no token past the embeddings."""
    import json

    from tokenizers import Tokenizer

    path, _, hf = pair
    with open(f"{path}/config.json", encoding="utf-8") as f:
        config = json.load(f)
    assert type(hf).__name__ == ("Qwen2Tokenizer" if config["model_type"].startswith("qwen") else "TokenizersBackend")
    assert len(hf) == config["vocab_size"]
    alone = Tokenizer.from_file(f"{path}/tokenizer.json")
    for text in TRICKY:
        assert alone.encode(text).ids == hf.encode(text), text


def test_truncation_and_padding_in_tokenizer_json_are_off_as_in_transformers(model_factory, tmp_path, monkeypatch):
    import shutil

    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path = str(tmp_path / "model")
    shutil.copytree(model_factory("llama"), path)
    written = Tokenizer.from_file(f"{path}/tokenizer.json")
    written.enable_truncation(max_length=4)
    written.enable_padding(length=64)
    written.save(f"{path}/tokenizer.json")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    text = "the river and the mountain city " * 3
    want = AutoTokenizer.from_pretrained(path).encode(text)
    assert len(want) > 4
    for _ in range(2):  # built, then read back from the cache
        assert load_tokenizer(path).tokenizer.encode(text).ids == want
