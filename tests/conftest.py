"""Shared fixtures: built-in tiny models of each architecture, created once per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """model_factory(arch, preset="tiny") -> path of a deterministic HF-format model directory."""
    from common.model.create import create_model

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
