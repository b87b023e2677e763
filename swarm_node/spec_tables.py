"""The tables of a run spec file checked key by key before any setting is built: an
unknown key (a typo) is named with its table and the closest known key, and a value of
the wrong type with its key, so that neither reaches a constructor, whose own error
would name Python internals instead of the setting."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

from swarm_node.errors import ConfigError

TOP_LEVEL = "the top-level table"


def check_table(raw: Any, cls: type, table: str, *, extra: tuple[str, ...] = ()) -> None:
    """``raw`` is a table whose keys are ``cls``'s fields (and ``extra``), each value of
    its field's type; nested dataclass fields must be tables (checked by the caller)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{table} must be a table of settings, got {_shown(raw)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)] + list(extra)
    for key, value in raw.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean {close[0]}?" if close else f"the keys there are {', '.join(names)}"
            raise ConfigError(f"unknown key {key} in {table}; {hint}")
        if key in hints and not _fits(hints[key], value):
            where = "" if table == TOP_LEVEL else f"{table} "
            raise ConfigError(f"{where}{key} must be {_kind(hints[key])}, got {_shown(value)}")


def _fits(hint: Any, value: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_fits(arg, value) for arg in args)
    if hint is type(None):
        return value is None
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(args[0], item) for item in value)
        return len(value) == len(args) and all(_fits(a, item) for a, item in zip(args, value))
    if dataclasses.is_dataclass(hint):
        return isinstance(value, dict)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True  # a type this check does not know: the setting's own check decides


_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
_PLURALS = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}


def _kind(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        kinds = [_kind(arg) for arg in args if arg is not type(None)]
        return " or ".join(kinds) + (" (or left out)" if type(None) in args else "")
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_PLURALS.get(args[0], 'values')}"
        return f"a list of {len(args)} {_PLURALS.get(args[0], 'values')}"
    if dataclasses.is_dataclass(hint):
        return "a table"
    return _KINDS.get(hint, getattr(hint, "__name__", str(hint)))


def _shown(value: Any) -> str:
    kind = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "a list",
            dict: "a table"}.get(type(value), type(value).__name__)
    return f"{value!r} ({kind})" if not isinstance(value, (list, dict)) else kind
