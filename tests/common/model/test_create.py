"""Built-in model creation: byte-identical output, HF-loadable tokenizer and chat template, varied outputs."""

from __future__ import annotations

import argparse
import filecmp
import os

import pytest

from tandem.common.model import create
from tandem.common.model.create import create_model
from tandem.common.model.config import ModelConfig
from tandem.common.model.loader import load_model
from tandem.common.tokenizer import load_tokenizer
from tests.common.model.conftest import PagedRunner

EXPECTED_FILES = ["config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
                  "tokenizer.json", "tokenizer_config.json"]
TEXT = "Hello, world! Café naïve 中文 🚀 costs 42.50 — ok?\nNew line."


def test_same_command_twice_gives_byte_identical_files(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    create_model(a, arch="qwen3", preset="tiny")
    create_model(b, arch="qwen3", preset="tiny")
    assert sorted(os.listdir(a)) == EXPECTED_FILES
    match, mismatch, errors = filecmp.cmpfiles(a, b, EXPECTED_FILES, shallow=False)
    assert match == EXPECTED_FILES and not mismatch and not errors


def test_hf_auto_tokenizer_loads_and_applies_chat_template(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 中文"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi 中文<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids[0] == tok.bos_token_id == 0 and ids.count(0) == 1
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [2, 3]
    assert tok.decode(tok(TEXT)["input_ids"], skip_special_tokens=True) == TEXT


def test_our_tokenizer_round_trips_multibyte_text(tiny_llama):
    tokenizer = load_tokenizer(tiny_llama).tokenizer
    ids = tokenizer.encode(TEXT).ids
    assert ids[0] == 0  # bos is added, like Llama 3's tokenizer
    assert len(ids) < len(TEXT.encode("utf-8"))  # merges were learned
    assert tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    assert tokenizer.get_vocab_size() == 512


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral"])
def test_greedy_decoding_is_varied(model_factory, arch):
    config, model = load_model(model_factory(arch), dtype="float32")
    runner = PagedRunner(config, model, page_size=4)
    token = int(runner.extend({0: [0, 50, 60, 70]}, all_logits=False).argmax(-1))
    out = [token]
    for _ in range(30):
        token = int(runner.decode({0: token}).argmax(-1))
        out.append(token)
    assert len(set(out)) >= 10, out


def test_unknown_arch_or_preset_is_refused(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        create_model(str(tmp_path / "x"), arch="gpt2")
    with pytest.raises(ValueError, match="preset"):
        create_model(str(tmp_path / "y"), preset="huge")


def test_cli_create_and_refuse_non_empty_dir(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    create.register(parser.add_subparsers(dest="command"))
    out = str(tmp_path / "cli")
    args = parser.parse_args(["model", "create", out, "--arch", "qwen2", "--preset", "tiny"])
    assert args.func(args) == 0
    assert os.path.isfile(os.path.join(out, "model.safetensors"))
    with pytest.raises(ValueError, match="--force"):
        args.func(args)
    args = parser.parse_args(["model", "create", out, "--preset", "tiny", "--force"])
    assert args.func(args) == 0


def test_default_model_dir_creates_once_under_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    made = []
    monkeypatch.setattr(create, "create_model", lambda d, arch, preset: made.append((arch, preset)) or
                        open(os.path.join(d, "config.json"), "w").close())
    path = create.default_model_dir()
    assert path == os.path.join(str(tmp_path), "models", "small-llama") and os.path.isfile(path + "/config.json")
    assert create.default_model_dir() == path and made == [("llama", "small")]


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_cli_creates_moe_models_transformers_loads(tmp_path, arch):
    """docs/moe.md's `tandem model create DIR --arch qwen3_moe ...`: transformers builds the same architecture from
    the directory and finds every tensor it expects."""
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser()
    create.register(parser.add_subparsers(dest="command"))
    out = str(tmp_path / arch)
    args = parser.parse_args(["model", "create", out, "--arch", arch, "--preset", "tiny"])
    assert args.func(args) == 0
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(model).__name__ == ModelConfig.from_pretrained(out).architecture
    assert not info["missing_keys"] and not info["unexpected_keys"]
