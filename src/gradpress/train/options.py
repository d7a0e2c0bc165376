"""Command-line options generated from a config dataclass: each option is defined once, as a field.

A field declared with :func:`option` carries its help text (and optionally a metavar, a list of
choices shown in the help, or a positional role) in its metadata; :func:`add_arguments` turns
every such field into an ``argparse`` argument and :func:`from_namespace` builds the config back
from the parsed namespace. The mapping from a field to its option:

1. the option is ``--`` plus the field name with ``_`` as ``-``; a ``bool`` field whose default
   is True becomes ``--no-NAME`` (it turns the field off), one whose default is False ``--NAME``,
   and a ``bool | None`` field (default None: decided later) the pair ``--NAME``/``--no-NAME``;
2. the value type is the field's type without ``None``: ``int``, ``float`` or ``str``; a
   ``tuple[X, ...]`` takes one or more values and a ``tuple[X, X]`` exactly two;
3. the default is the field's; the help ends with it (and the choices) unless it is None (the
   help then says what None means) or empty; a ``--no-NAME`` flag's help starts "turn off:";
4. a ``positional`` field takes the rest of the command line (``-- CMD ...``).

Validation stays in the config class (its ``__post_init__``), so a bad value gives the same
message from the command line and from Python.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["option", "add_arguments", "from_namespace", "option_fields", "flag_of"]


def option(default: Any, help: str, *, metavar: str | None = None,  # noqa: A002
           choices: Sequence[str] | Callable[[], Sequence[str]] | None = None,
           positional: bool = False) -> Any:
    """A dataclass field that is also a command-line option (see the module docstring).

    ``choices`` (a sequence, or a function returning one, called when the help is built) are
    listed in the help; the config validates them.
    """
    meta = {"help": help, "metavar": metavar, "choices": choices, "positional": positional}
    return dataclasses.field(default=default, metadata={"option": meta})


def option_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` declared with :func:`option`, in declaration order."""
    return [f for f in dataclasses.fields(cls) if "option" in f.metadata]


def flag_of(f: dataclasses.Field) -> str:
    """The command-line spelling of field ``f`` (``--dense-steps``, ``--no-progress``)."""
    name = f.name.replace("_", "-")
    if f.metadata["option"]["positional"]:
        return name
    if f.default is True:
        return f"--no-{name}"
    return f"--{name}"


def _value_type(tp: Any) -> tuple[Any, str | int | None]:
    """(element type, nargs) of a field type: ``int | None`` -> (int, None),
    ``tuple[str, ...]`` -> (str, "+"), ``tuple[float, float]`` -> (float, 2)."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"option type {tp} must be one type or None")
        tp = args[0]
    if typing.get_origin(tp) is tuple:
        items = typing.get_args(tp)
        if len(items) == 2 and items[1] is Ellipsis:
            return items[0], "+"
        if len(set(items)) != 1:
            raise TypeError(f"option type {tp} must be tuple[X, ...] or tuple[X, X]")
        return items[0], len(items)
    return tp, None


def _help(f: dataclasses.Field, meta: dict[str, Any]) -> str:
    """The field's help text, then its choices and its default in parentheses."""
    text = meta["help"]
    if f.default is True:
        text = f"turn off: {text}"
    choices = meta["choices"]
    if callable(choices):
        choices = choices()
    parts = [f"one of {', '.join(choices)}"] if choices else []
    default = f.default
    if default is not None and not isinstance(default, bool) and default not in ((), ""):
        shown = " ".join(map(str, default)) if isinstance(default, tuple) else default
        parts.append(f"default: {shown}")
    if parts:
        text += f" ({'; '.join(parts)})"
    return text.replace("%", "%%")


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> argparse.ArgumentParser:
    """Add one argument per :func:`option` field of dataclass ``cls`` to ``parser``."""
    hints = typing.get_type_hints(cls)
    for f in option_fields(cls):
        meta = f.metadata["option"]
        kw: dict[str, Any] = {"help": _help(f, meta), "dest": f.name}
        if meta["positional"]:
            del kw["dest"]
            parser.add_argument(f.name, nargs=argparse.REMAINDER, metavar=meta["metavar"],
                                **kw)
            continue
        tp, nargs = _value_type(hints[f.name])
        if tp is bool and f.default is None:  # --NAME / --no-NAME, None when neither
            kw.update(action=argparse.BooleanOptionalAction, default=None)
        elif tp is bool:
            kw.update(action="store_false" if f.default else "store_true", default=f.default)
        else:
            kw.update(type=tp, default=f.default, metavar=meta["metavar"])
            if nargs is not None:
                kw["nargs"] = nargs
        parser.add_argument(flag_of(f), **kw)
    return parser


def from_namespace(cls: type, args: argparse.Namespace) -> Any:
    """``cls`` built from the fields :func:`add_arguments` parsed into ``args`` (sequences as
    tuples; a positional's leading ``--`` dropped)."""
    kw: dict[str, Any] = {}
    for f in option_fields(cls):
        value = getattr(args, f.name)
        if isinstance(value, list):
            if f.metadata["option"]["positional"] and value and value[0] == "--":
                value = value[1:]
            value = tuple(value)
        kw[f.name] = value
    return cls(**kw)
