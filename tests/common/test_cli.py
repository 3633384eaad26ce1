"""The `tandem` parser as a whole: every flag documented, --log-level on either side of the subcommand."""

from __future__ import annotations

import argparse
import os
from typing import Iterator

import pytest

from tandem.common.cli import build_parser, main

# Commands whose flags other work owns (common/bench, common/model/create.py); their help is checked there.


@pytest.fixture(autouse=True)
def _no_tandem_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("TANDEM_"):
            monkeypatch.delenv(name)


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
             ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """(command path, parser) of every leaf subcommand."""
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        yield path, parser
    for action in subparsers:
        for name, sub in action.choices.items():
            yield from commands(sub, path + (name,))


def test_every_flag_of_every_command_has_help():
    checked = set()
    for path, parser in commands(build_parser()):
        checked.add(path)
        for action in parser._actions:
            if action.option_strings:
                assert action.help and action.help.strip(), f"tandem {' '.join(path)} {action.option_strings[0]}"
    assert {("worker",), ("prefill",), ("decode",), ("router",), ("generate",), ("up",), ("model", "create"),
            ("bench", "offline"), ("bench", "serve"), ("bench", "kv"), ("bench", "report")} <= checked


@pytest.mark.parametrize("command, flag", [("decode", "--port"), ("prefill", "--bootstrap-timeout"),
                                           ("router", "--request-timeout-s"), ("up", "--ready-timeout"),
                                           ("generate", "--page-size")])
def test_help_shows_defaults(command, flag):
    parser = dict(commands(build_parser()))[(command,)]
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    assert f"(default: {action.default})" in action.help % {"default": action.default}


@pytest.mark.parametrize("argv, level", [
    (["--log-level", "debug", "worker", "--model", "m"], "debug"),
    (["worker", "--log-level", "info", "--model", "m"], "info"),
    (["--log-level", "debug", "router", "--worker", "h:1", "--log-level", "error"], "error"),
    (["router", "--worker", "h:1"], "warning"),
    (["bench", "kv", "--log-level", "info"], "info"),
])
def test_log_level_before_or_after_the_subcommand(argv, level):
    assert build_parser().parse_args(argv).log_level == level


@pytest.mark.parametrize("argv", [["worker", "--model-path", "m"], ["prefill", "--model-path", "m"],
                                  ["up", "--model-path", "m"], ["generate", "--model-path", "m", "--input", "-",
                                                                "--output", "-"]])
def test_model_path_accepted_wherever_model_is(argv):
    assert build_parser().parse_args(argv).model_path == "m"


def test_bad_env_value_is_a_clean_error(monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_MEM_FRACTION", "most")
    assert main(["worker", "--model", "m"]) == 2
    assert "TANDEM_MEM_FRACTION='most'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, command", [(["worker", "--model", "m"], "worker"),
                                           (["--log-level", "info", "router", "--worker", "h:1"], "router"),
                                           (["--log-level=info", "bench", "kv"], "bench"),
                                           (["-h"], None), ([], None)])
def test_the_command_is_the_first_word_after_the_top_level_options(argv, command):
    from tandem.common.cli import command_of

    assert command_of(argv) == command


@pytest.mark.e2e
def test_a_process_imports_only_its_own_command(tmp_path):
    """A router never loads torch and a worker never loads the router or the bench tools: each child of a stack
    starts seconds sooner. A worker loads torch when it builds its engine, not to parse its flags (a --dp-size N
    controller never does: tests/common/dp/test_controller_imports.py). One process per command, checked after its parser is built."""
    import subprocess
    import sys

    from tests.common.rpc.helpers import REPO_ROOT

    script = ("import sys; from tandem.common import cli; cli.parser_for(sys.argv[1:]).parse_args(sys.argv[1:]); "
              "print(sorted(m for m in ('torch', 'tandem.services.router.main', 'tandem.common.bench.report', "
              "'tandem.common.rpc.unified_worker') if m in sys.modules))")
    for argv, loaded in ((["router", "--worker", "h:1"], ["tandem.services.router.main"]),
                         (["worker", "--model", "m"], ["tandem.common.rpc.unified_worker"]),
                         # the load generator shares the cores with the server it measures: no torch import
                         (["--log-level", "info", "bench", "serve", "--base-url", "http://h:1"], []),
                         (["bench", "report", "--sections", "1"], ["tandem.common.bench.report"]),
                         # the planner reads metrics over HTTP: neither torch nor the router
                         (["planner", "--router-url", "http://h:1"], [])):
        proc = subprocess.run([sys.executable, "-c", script, *argv], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split("\n")[0] == str(loaded), argv


def test_an_unknown_command_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["bogus"])
    err = capsys.readouterr().err
    assert "invalid choice: 'bogus'" in err and "router" in err and "bench" in err
