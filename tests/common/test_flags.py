"""tandem.common.flags: flags generated from a dataclass, their help, env overrides, aliases, bools and parse hooks."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

import pytest

from tandem.common.flags import ConfigError, add_flags, flag, from_flags, parse_bool


@dataclass
class Demo:
    name: str = flag("demo", "a name", aliases=("--label",))
    count: int = flag(3, "how many")
    ratio: float = flag(0.5, "a fraction")
    limit: Optional[int] = flag(None, "an optional cap")
    verbose: bool = flag(False, "say more")
    cache: bool = flag(True, "do not cache")
    mode: str = flag("fast", "fast or slow", choices=("fast", "slow"))
    tags: list[str] = flag([], "a tag", metavar="TAG")
    pairs: list[tuple[str, str]] = flag([], "KEY=VALUE", parse=lambda text: tuple(text.split("=", 1)))
    internal: int = 7  # no flag()


@pytest.fixture(autouse=True)
def _no_demo_env(monkeypatch):
    for name in ("NAME", "COUNT", "RATIO", "LIMIT", "VERBOSE", "NO_CACHE", "MODE", "TAGS", "PAIRS"):
        monkeypatch.delenv(f"DEMO_{name}", raising=False)


def parser_for(cls=Demo, **kwargs) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="demo")
    add_flags(parser, cls, title="demo", env_prefix="DEMO_", **kwargs)
    return parser


def build(argv: list[str], **kwargs) -> Demo:
    return from_flags(Demo, parser_for(**kwargs).parse_args(argv))


def test_defaults_round_trip_to_the_dataclass_defaults():
    assert build([]) == Demo()


def test_one_flag_per_field_with_the_field_name_as_dest():
    args = parser_for().parse_args(["--name", "x", "--count", "4", "--ratio", "0.25", "--limit", "9", "--verbose",
                                    "--no-cache", "--mode", "slow", "--tags", "a", "--tags", "b",
                                    "--pairs", "k=v"])
    assert (args.name, args.count, args.ratio, args.limit, args.verbose, args.cache, args.mode) == \
        ("x", 4, 0.25, 9, True, False, "slow")
    assert args.tags == ["a", "b"] and not hasattr(args, "internal")
    config = from_flags(Demo, args)
    assert config.pairs == [("k", "v")] and config.internal == 7


def test_alias_sets_the_same_field():
    assert build(["--label", "other"]).name == "other"


def test_help_shows_text_default_and_env_for_every_flag():
    text = " ".join(parser_for().format_help().split())  # argparse wraps lines
    assert "how many (default: 3) [env DEMO_COUNT]" in text
    assert "a fraction (default: 0.5) [env DEMO_RATIO]" in text
    assert "do not cache [env DEMO_NO_CACHE]" in text
    assert "an optional cap [env DEMO_LIMIT]" in text  # no default to show
    for action in parser_for()._actions:
        assert action.help, action.option_strings


def test_env_overrides_each_kind(monkeypatch):
    monkeypatch.setenv("DEMO_NAME", "from-env")
    monkeypatch.setenv("DEMO_COUNT", "11")
    monkeypatch.setenv("DEMO_RATIO", "0.75")
    monkeypatch.setenv("DEMO_LIMIT", "5")
    monkeypatch.setenv("DEMO_MODE", "slow")
    monkeypatch.setenv("DEMO_TAGS", "x  y")
    monkeypatch.setenv("DEMO_PAIRS", "a=1 b=2")
    config = build([])
    assert (config.name, config.count, config.ratio, config.limit, config.mode) == ("from-env", 11, 0.75, 5, "slow")
    assert config.tags == ["x", "y"] and config.pairs == [("a", "1"), ("b", "2")]
    assert build(["--count", "1"]).count == 1  # the flag wins over the env
    assert build(["--tags", "z"]).tags == ["x", "y", "z"]  # a repeated flag adds to the env's list


@pytest.mark.parametrize("text, value", [("1", True), ("TRUE", True), ("yes", True), ("on", True),
                                         ("0", False), ("false", False), ("No", False), ("off", False)])
def test_bool_env(monkeypatch, text, value):
    monkeypatch.setenv("DEMO_VERBOSE", text)
    monkeypatch.setenv("DEMO_NO_CACHE", text)  # names the --no-cache flag: "1" turns caching off
    config = build([])
    assert config.verbose is value and config.cache is (not value)


def test_empty_env_counts_as_unset(monkeypatch):
    monkeypatch.setenv("DEMO_COUNT", "")
    monkeypatch.setenv("DEMO_LIMIT", " ")
    assert build([]) == Demo()


@pytest.mark.parametrize("env, text, words", [
    ("DEMO_COUNT", "three", "expected an integer"),
    ("DEMO_RATIO", "half", "expected a number"),
    ("DEMO_VERBOSE", "maybe", "expected one of 1/true/yes/on or 0/false/no/off"),
    ("DEMO_MODE", "medium", "expected one of fast, slow"),
])
def test_bad_env_value_names_the_variable(monkeypatch, env, text, words):
    monkeypatch.setenv(env, text)
    with pytest.raises(ConfigError) as error:
        parser_for()
    assert f"{env}={text!r}" in str(error.value) and words in str(error.value)


def test_bad_flag_value_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        parser_for().parse_args(["--count", "three"])
    assert exit_.value.code == 2
    assert "argument --count: expected an integer, got 'three'" in capsys.readouterr().err


def test_required_unless_the_env_names_it(monkeypatch):
    with pytest.raises(SystemExit):
        parser_for(required=("name",)).parse_args([])
    monkeypatch.setenv("DEMO_NAME", "set")
    assert from_flags(Demo, parser_for(required=("name",)).parse_args([])).name == "set"


def test_exclude_and_groups():
    @dataclass
    class Grouped:
        a: int = flag(1, "first", group="one")
        b: int = flag(2, "second")

    parser = argparse.ArgumentParser()
    add_flags(parser, Grouped, title="rest", env_prefix="G_", exclude=("a",))
    assert parser.parse_args([]) == argparse.Namespace(b=2)
    parser = argparse.ArgumentParser()
    add_flags(parser, Grouped, title="rest", env_prefix="G_")
    titles = [g.title for g in parser._action_groups]
    assert titles.index("one") < titles.index("rest")


def test_fields_missing_from_the_namespace_keep_their_defaults():
    assert from_flags(Demo, argparse.Namespace(count=5)) == Demo(count=5)
    assert from_flags(Demo, argparse.Namespace(count=5), count=6).count == 6


def test_percent_in_help_is_literal():
    @dataclass
    class Percent:
        share: float = flag(0.9, "90% of memory")

    parser = argparse.ArgumentParser()
    add_flags(parser, Percent, title="p", env_prefix="P_")
    assert "90% of memory" in parser.format_help()


def test_a_type_without_a_parse_hook_is_refused():
    @dataclass
    class Odd:
        thing: complex = flag(1j, "a complex number")

    with pytest.raises(TypeError, match="parse"):
        add_flags(argparse.ArgumentParser(), Odd, title="odd", env_prefix="O_")


def test_parse_bool_names_its_source():
    assert parse_bool(" On ", "X") is True
    with pytest.raises(ConfigError, match="X='2'"):
        parse_bool("2", "X")


def test_a_flag_without_help_is_refused():
    @dataclass
    class Silent:
        quiet: int = flag(1, " ")

    with pytest.raises(TypeError, match="help"):
        add_flags(argparse.ArgumentParser(), Silent, title="s", env_prefix="S_")
