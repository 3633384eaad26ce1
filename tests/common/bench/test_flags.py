"""The `tandem bench` commands' flags: each has a help line that shows its default, model directories are taken
as --model or --model-path, and every `tandem bench` command the docs show parses."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from tandem.common import cli

REPO = Path(__file__).resolve().parents[3]
DOCS = ("README.md", "docs/performance.md", "docs/performance-history.md", "docs/parallelism.md")


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def bench_parser(command: str) -> argparse.ArgumentParser:
    return subcommands(subcommands(cli.build_parser())["bench"])[command]


@pytest.mark.parametrize("command", ["offline", "serve", "kv", "report", "grammar", "moe", "quant", "hicache"])
def test_every_flag_has_help_that_shows_its_default(command):
    parser = bench_parser(command)
    formatter = parser.formatter_class(prog=parser.prog)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"tandem bench {command} {action.option_strings[0]} has no help"
        assert "default" in formatter._get_help_string(action), f"{action.option_strings[0]} hides its default"


@pytest.mark.parametrize("command", ["offline", "report", "grammar", "moe", "quant", "hicache"])
def test_model_directory_is_model_or_model_path(command):
    parser = cli.build_parser()
    for flag in ("--model", "--model-path"):
        assert parser.parse_args(["bench", command, flag, "/models/m"]).model == "/models/m"


def documented_bench_commands() -> list[str]:
    """`tandem bench ...` lines of the docs' shell blocks, continuation lines joined, comments dropped."""
    commands = []
    for doc in DOCS:
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", (REPO / doc).read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("#", 1)[0].strip()
                if line.startswith("tandem bench "):
                    commands.append(line)
    return commands


def test_documented_bench_commands_parse():
    commands = documented_bench_commands()
    assert {c.split()[2] for c in commands} >= {"report", "kv", "peer", "serve", "stall"}  # docs/performance.md
    parser = cli.build_parser()
    for command in commands:
        args = parser.parse_args(shlex.split(command)[1:])
        assert callable(args.func), command
