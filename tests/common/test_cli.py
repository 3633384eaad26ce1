"""The `tandem` parser as a whole: every flag documented, --log-level on either side of the subcommand."""

from __future__ import annotations

import argparse
import os
from typing import Iterator

import pytest

from common.cli import build_parser, main

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
