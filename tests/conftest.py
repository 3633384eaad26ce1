"""Shared fixtures: built-in tiny models of each architecture, created once per test session."""

from __future__ import annotations

import os

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


# CI installs every test dependency (smg, helm-python-sdk, ...), so there a skip means a broken install, not a
# machine without the tool: fail it instead of letting it hide. Only tests marked `needs_gpu` (CI never has a GPU;
# they run on a machine that has one: tests/common/model/test_cuda_paths.py) or `needs_cpu_feature` (a code path
# this CPU's instruction set cannot run; the other paths are forced on every CPU) may skip there.
_MAY_SKIP = ("needs_gpu", "needs_cpu_feature")
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
