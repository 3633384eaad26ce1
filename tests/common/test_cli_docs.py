"""docs/cli.md is what `python -m tandem.common.docs_cli` writes from today's parsers: a flag added, removed or
re-worded without regenerating it fails here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.common import docs_cli


def test_docs_cli_md_is_current():
    assert docs_cli.DOC.read_text() == docs_cli.render(), "stale: run python -m tandem.common.docs_cli"


def test_every_command_has_a_section():
    text = docs_cli.render()
    for command in ("model create", "generate", "worker", "prefill", "decode", "router", "up", "bench offline",
                    "bench serve", "bench kv", "bench report", "bench chaos", "bench peer"):
        assert f"## `tandem {command}`" in text


def test_an_env_variable_does_not_change_the_doc(monkeypatch):
    monkeypatch.setenv("TANDEM_PAGE_SIZE", "64")
    assert docs_cli.render() == docs_cli.DOC.read_text()


def test_check_fails_on_a_stale_doc(tmp_path, monkeypatch):
    stale = tmp_path / "cli.md"
    stale.write_text(docs_cli.render().replace("--page-size", "--page-sise"))
    monkeypatch.setattr(docs_cli, "DOC", stale)
    assert docs_cli.main(["--check"]) == 1
    assert docs_cli.main([]) == 0 and docs_cli.main(["--check"]) == 0


@pytest.mark.e2e
def test_the_command_runs_as_documented():
    """`python -m tandem.common.docs_cli --check`, as docs/cli.md's header says."""
    done = subprocess.run([sys.executable, "-m", "tandem.common.docs_cli", "--check"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
