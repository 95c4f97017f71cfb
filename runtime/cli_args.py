"""Command-line flags declared once, on the fields of a frozen dataclass, and the one mapping that uses them.

A field says how it is spelled in its metadata: `field(default=..., metadata=flag("what it does", ...))`.
A dataclass that also inherits CliConfig adds its fields to a parser, builds itself back from the parsed
namespace, and writes an instance as the flags that rebuild it. Types, defaults and help come from the
dataclass, so `ringllm serve`, the benchmarks, the supervisor and `LLM` cannot drift apart. Every field
needs a flag, or is a nested CliConfig whose fields join the same parser: a new setting cannot be left
out of the command line, and a round trip through the flags gives back the same config."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Self


@dataclass(frozen=True)
class Flag:
    """How one field is spelled on the command line.

    A boolean is a flag that sets True; a True default needs `inverse`, the flag that sets it False
    (--disable-prefix-cache), unless it is `negatable` (--warm-spares and --no-warm-spares). A value
    argparse cannot type, such as a JSON list, is read by `parse` and written back by `show`."""

    help: str
    names: tuple[str, ...] = ()  # every spelling, the first written by to_cli_args; none: --field-name
    choices: Sequence[Any] | None = None
    metavar: str | None = None
    inverse: str | None = None
    negatable: bool = False
    parse: Callable[[str], Any] | None = None
    show: Callable[[Any], str] | None = None


def flag(help: str, names: tuple[str, ...] = (), **options: Any) -> dict[str, Flag]:
    """A field's metadata: its help text, its spellings and the Flag options."""
    return {"flag": Flag(help, names, **options)}


class CliConfig:
    """A frozen dataclass whose every field declares its flag (runtime.cli_args.flag) or is a nested CliConfig."""

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, only: Collection[str] | None = None) -> None:
        """Each field as an argument whose dest is its name (a nested config's fields too); `only`: just these fields."""
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if only is not None and f.name not in only:
                continue
            if (nested := _nested(f)) is not None:
                nested.add_cli_args(parser)
            else:
                _add_argument(parser, cls, f, _base_type(hints[f.name]))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **given: Any) -> Self:
        """The config a parsed namespace asks for; `given` holds fields the caller resolved itself, and wins."""
        hints = typing.get_type_hints(cls)
        values = {
            f.name: nested.from_cli_args(args) if (nested := _nested(f)) else _parsed(f, _base_type(hints[f.name]), getattr(args, f.name))
            for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            if f.name not in given
        }
        return cls(**values, **given)

    def to_cli_args(self) -> list[str]:
        """The flags that rebuild this config: values other than the default only, a boolean as its flag, None
        left out, a tuple's items one flag each; a value is joined to its flag by '=', so it may start with '-'."""
        written: list[str] = []
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if _nested(f) is not None:
                written += value.to_cli_args()
            elif value is not None and (f.default is dataclasses.MISSING or value != f.default):
                written += _written(f, value)
        return written


def _nested(f: dataclasses.Field) -> type[CliConfig] | None:
    """The CliConfig a field holds whole (its default_factory), or None for a field of its own."""
    factory = f.default_factory
    return factory if isinstance(factory, type) and issubclass(factory, CliConfig) else None


def _base_type(hint: Any) -> Any:
    """`int | None` -> int; any other hint as it is."""
    if isinstance(hint, types.UnionType):
        return next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


def _names(f: dataclasses.Field) -> tuple[str, ...]:
    """A field's spellings; the first is the one to_cli_args writes."""
    return f.metadata["flag"].names or ("--" + f.name.replace("_", "-"),)


def _add_argument(parser: argparse.ArgumentParser, cls: type, f: dataclasses.Field, kind: Any) -> None:
    spec: Flag | None = f.metadata.get("flag")
    if spec is None:
        raise TypeError(f"{cls.__name__}.{f.name} declares no flag: give it metadata=flag(...)")
    default = None if f.default is dataclasses.MISSING else f.default
    common: dict[str, Any] = {"dest": f.name, "help": _help(spec, default)}
    if kind is bool:
        if spec.negatable:
            parser.add_argument(*_names(f), action=argparse.BooleanOptionalAction, default=default, **common)
        elif default:
            if spec.inverse is None:
                raise TypeError(f"{cls.__name__}.{f.name} is True by default: give its flag an inverse or make it negatable")
            parser.add_argument(spec.inverse, action="store_false", **common)
        else:
            parser.add_argument(*_names(f), action="store_true", **common)
    elif spec.parse is None and typing.get_origin(kind) is tuple:  # `--x A B` and `--x A --x B` alike, as SGLang's and vLLM's lists
        parser.add_argument(*_names(f), action="extend", nargs="+", type=typing.get_args(kind)[0], metavar=spec.metavar, **common)
    else:
        typed = {"type": kind, "default": default} if spec.parse is None else {}
        metavar = spec.metavar or (None if spec.choices else _names(f)[0].removeprefix("--").replace("-", "_").upper())
        parser.add_argument(*_names(f), choices=spec.choices, metavar=metavar, **typed, **common)


def _help(spec: Flag, default: Any) -> str:
    """The help text with the default said, unless it says it already or there is none to say."""
    if "default" in spec.help or default in (None, ()) or isinstance(default, bool) and not spec.negatable:
        return spec.help
    return f"{spec.help} (default: {('off', 'on')[default] if isinstance(default, bool) else '%(default)s'})"


def _parsed(f: dataclasses.Field, kind: Any, value: Any) -> Any:
    """A field's value from what argparse left in the namespace."""
    if value is None:
        return None if f.default is dataclasses.MISSING else f.default
    if (parse := f.metadata["flag"].parse) is not None:
        return parse(value)
    return tuple(value) if typing.get_origin(kind) is tuple else value


def _written(f: dataclasses.Field, value: Any) -> list[str]:
    spec, first = f.metadata["flag"], _names(f)[0]
    if isinstance(value, bool):
        if spec.negatable:
            return [first if value else "--no-" + first.removeprefix("--")]
        return [first] if value else [spec.inverse]  # type: ignore[list-item]
    if spec.show is not None:
        return [f"{first}={spec.show(value)}"]
    if isinstance(value, tuple):
        return [f"{first}={item}" for item in value]
    return [f"{first}={value}"]


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets) as (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"an address is HOST:PORT, not {address!r}")
    return host.strip("[]"), int(port)
