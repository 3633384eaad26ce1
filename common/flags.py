"""CLI flags generated from a config dataclass: one `--flag` per field, help with its default, an env override."""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any, Callable, Iterable, Optional, Sequence

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_SCALARS = (bool, int, float, str)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag (or env var) and what to fix."""


def flag(default: Any, help: str, *, name: Optional[str] = None,
         aliases: Sequence[str] = (), choices: Optional[Sequence[str]] = None,
         parse: Optional[Callable[[str], Any]] = None, metavar: Optional[str] = None,
         group: Optional[str] = None, inverse: Sequence[str] = ()) -> Any:
    """A dataclass field that add_flags turns into a flag; `help` says what it sets (never empty).

    name: the flag (default `--field-name`, or `--no-field-name` for a bool that defaults to True);
    aliases: more spellings of it; inverse (bool fields): spellings that set the opposite value (vLLM's
    `--enable-prefix-caching` for `--disable-radix-cache`), so the last one given wins; parse: turns each
    command-line string into the field's value (each item of a list) when the config is built, so its error message
    reaches the user as written; group: the --help section.
    """
    metadata = {"help": help, "name": name, "aliases": tuple(aliases), "choices": choices, "parse": parse,
                "metavar": metavar, "group": group, "inverse": tuple(inverse)}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class _Spec:
    """One field as a flag."""

    field: dataclasses.Field
    item_type: Any  # the type behind Optional[...] and list[...]
    is_list: bool
    flag: str
    env: str

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def default(self) -> Any:
        f = self.field
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

    def meta(self, key: str) -> Any:
        return self.field.metadata[key]


def _unwrap(hint: Any) -> tuple[Any, bool]:
    """(item type, is a list) of a field's type: Optional[X] → X, list[X] → (X, True)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], True
    return hint, False


def _specs(cls: type, env_prefix: str) -> list[_Spec]:
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:  # not declared with flag(): not a command-line setting
            continue
        if not f.metadata["help"].strip():
            raise TypeError(f"{cls.__name__}.{f.name}: flag() needs a help line")
        item_type, is_list = _unwrap(hints[f.name])
        if item_type not in _SCALARS and f.metadata["parse"] is None:
            raise TypeError(f"{cls.__name__}.{f.name}: a {item_type} field needs flag(parse=...)")
        name = f.metadata["name"] or _flag_name(f, item_type, is_list)
        env = env_prefix + name.lstrip("-").upper().replace("-", "_")
        specs.append(_Spec(f, item_type, is_list, name, env))
    return specs


def _flag_name(f: dataclasses.Field, item_type: Any, is_list: bool) -> str:
    negated = item_type is bool and not is_list and f.default is True
    return ("--no-" if negated else "--") + f.name.replace("_", "-")


def parse_bool(text: str, source: str) -> bool:
    """1/true/yes/on or 0/false/no/off (any case); anything else is an error naming `source`."""
    value = text.strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ConfigError(f"{source}={text!r}: expected one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)}")


def _typed(spec: _Spec, text: str) -> Any:
    """One command-line or env string as the field's item type (kept a string when a parse hook owns it)."""
    if spec.meta("parse") is not None or spec.item_type is str:
        return text
    return spec.item_type(text)  # int or float: ValueError when it is not one


_TYPE_WORDS = {int: "an integer", float: "a number"}


def _from_env(spec: _Spec, text: str) -> Any:
    try:
        return _typed(spec, text)
    except ValueError:
        raise ConfigError(f"{spec.env}={text!r}: expected {_TYPE_WORDS[spec.item_type]} (for {spec.flag})") from None


def _from_arg(spec: _Spec, text: str) -> Any:
    try:
        return _typed(spec, text)
    except ValueError:  # argparse reports it as "argument --flag: ..." and exits 2
        raise argparse.ArgumentTypeError(f"expected {_TYPE_WORDS[spec.item_type]}, got {text!r}") from None


def _env_default(spec: _Spec) -> Any:
    """The field's default, or what its env var says instead (an empty variable counts as unset)."""
    raw = os.environ.get(spec.env, "").strip()
    if not raw:
        return spec.default
    if spec.item_type is bool and not spec.is_list:
        # The variable means "as if the flag were given", so TANDEM_X_NO_Y=1 turns Y off.
        return (not spec.default) if parse_bool(raw, spec.env) else spec.default
    if spec.is_list:  # whitespace-separated: a prefill URL carries a comma of its own
        return [_from_env(spec, item) for item in raw.split()]
    value = _from_env(spec, raw)
    choices = spec.meta("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{spec.env}={raw!r}: expected one of {', '.join(choices)} (for {spec.flag})")
    return value


def _help(spec: _Spec, default: Any, required: bool) -> str:
    text = spec.meta("help")
    if required:
        text += " (required)"
    elif spec.is_list:
        text += " (repeatable)"
    elif default is not None and default != "" and not isinstance(default, bool):
        text += f" (default: {default})"
    return f"{text} [env {spec.env}]".replace("%", "%%")  # argparse %-formats help


def _add_one(group: argparse._ArgumentGroup, spec: _Spec, required: bool) -> None:
    default = _env_default(spec)
    required = required and not os.environ.get(spec.env, "").strip()
    names = [spec.flag, *spec.meta("aliases")]
    kwargs: dict[str, Any] = dict(dest=spec.name, default=default, help=_help(spec, default, required))
    if spec.item_type is bool and not spec.is_list:
        group.add_argument(*names, action="store_false" if spec.default else "store_true", **kwargs)
        if spec.meta("inverse"):
            group.add_argument(*spec.meta("inverse"), action="store_true" if spec.default else "store_false",
                               dest=spec.name, default=default, help=f"the opposite of {spec.flag}")
        return
    kwargs.update(choices=spec.meta("choices"), metavar=spec.meta("metavar"), required=required,
                  type=lambda text: _from_arg(spec, text))
    group.add_argument(*names, action="append" if spec.is_list else "store", **kwargs)


def add_flags(parser: argparse.ArgumentParser, cls: type, *, title: str, env_prefix: str,
              required: Iterable[str] = (), exclude: Iterable[str] = (), section_prefix: str = "") -> None:
    """One flag per flag() field of dataclass `cls`, in the --help section `title` (or the field's own group,
    after `section_prefix`: `tandem up` shows the router's as "router: routing").

    Each default may be overridden by env `env_prefix` + the flag's name (upper case, '-' → '_'); a bad value
    raises ConfigError naming the variable. List fields repeat (`--x A --x B`, which add to the env's list).
    A `required` field is not required when its env var is set.
    """
    required, exclude = set(required), set(exclude)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for spec in _specs(cls, env_prefix):
        if spec.name in exclude:
            continue
        section = section_prefix + spec.meta("group") if spec.meta("group") else title
        if section not in groups:
            groups[section] = parser.add_argument_group(section)
        _add_one(groups[section], spec, spec.name in required)


def refuse_abbreviations(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Turn off argparse's prefix matching on `parser` and every subparser under it: it would take vLLM's
    `--tokenizer DIR` as `--tokenizer-cache-dir DIR` without a word, so only whole flag names are accepted."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                refuse_abbreviations(sub)
    return parser


def from_flags(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """An instance of `cls` from parsed flags: parse hooks run here; fields without a flag in `args` keep their
    defaults; `overrides` win over both."""
    values = dict(overrides)
    for f in dataclasses.fields(cls):
        if f.name in values or "help" not in f.metadata or not hasattr(args, f.name):
            continue
        value, parse = getattr(args, f.name), f.metadata["parse"]
        if parse is not None and value is not None:
            value = [parse(v) for v in value] if isinstance(value, list) else parse(value)
        values[f.name] = value
    return cls(**values)


def to_argv(obj: Any, env_prefix: str) -> tuple[list[str], list[str]]:
    """The flags that rebuild dataclass `obj` (the values that differ from the field defaults), and the env
    variables that could override them, for starting a child process with exactly this configuration."""
    argv: list[str] = []
    for spec in _specs(type(obj), env_prefix):
        value = getattr(obj, spec.name)
        if value == spec.default:
            continue
        if spec.item_type is bool and not spec.is_list:
            argv.append(spec.flag)  # a store_true flag (or --no-x for a default of True) flips the default
        elif spec.is_list:
            for item in value:
                argv += [spec.flag, str(item)]
        elif isinstance(value, (tuple, list)):  # a parse hook's sequence (e.g. batch sizes), written back as text
            argv += [spec.flag, ",".join(str(v) for v in value)]
        else:
            argv += [spec.flag, str(value)]
    return argv, [spec.env for spec in _specs(type(obj), env_prefix)]
