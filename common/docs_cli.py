"""Writes docs/cli.md from the `tandem` parsers (built from the flag dataclasses): `python -m
tandem.common.docs_cli` rewrites it, `--check` fails when it is stale."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from unittest import mock

from tandem.common.cli import build_parser

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
HEADER = """# The `tandem` command

Generated from the flag dataclasses by `python -m tandem.common.docs_cli`; do not edit by hand.
Every flag reads an env variable too (named in brackets); `--log-level` goes before or after a subcommand.
"""
SKIPPED = {"-h", "--log-level"}


def subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """Each subcommand's parser and its one-line help."""
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not actions:
        return {}
    helps = {a.dest: a.help or "" for a in actions[0]._choices_actions}
    return {name: (sub, helps.get(name, "")) for name, sub in actions[0].choices.items()}


def help_line(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    text = parser._get_formatter()._expand_help(action) if action.help else ""
    return " ".join(text.split()).replace("|", "\\|")


def flag_cell(action: argparse.Action) -> str:
    names = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}`"
    if action.choices and action.nargs != 0:
        names += " " + "\\|".join(str(c) for c in action.choices)
    return names


def command_section(title: str, parser: argparse.ArgumentParser, summary: str) -> list[str]:
    lines = [f"## `{title}`", ""]
    if summary or parser.description:
        lines += [" ".join((summary or parser.description).split()), ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._SubParsersAction)
                   and not SKIPPED & set(a.option_strings)]
        if not actions:
            continue
        lines += [f"**{group.title}**", "", "| flag | what it sets |", "| --- | --- |"]
        lines += [f"| {flag_cell(a)} | {help_line(parser, a)} |" for a in actions]
        lines.append("")
    return lines


def render() -> str:
    """docs/cli.md's text, with no TANDEM_* variable in the environment (each would change a default)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    with mock.patch.dict(os.environ, clean, clear=True):
        root = build_parser()
    lines = [HEADER]
    for name, (parser, summary) in subcommands(root).items():
        nested = subcommands(parser)
        if not nested:
            lines += command_section(f"tandem {name}", parser, summary)
        for sub_name, (sub, sub_summary) in nested.items():
            lines += command_section(f"tandem {name} {sub_name}", sub, sub_summary)
    # A default under the home directory (a cache) reads the same on every machine.
    return "\n".join(lines).rstrip().replace(str(Path.home()), "~") + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tandem.common.docs_cli", description=__doc__)
    p.add_argument("--check", action="store_true", help="fail (exit 1) when docs/cli.md is stale; write nothing")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is stale: run python -m tandem.common.docs_cli", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
