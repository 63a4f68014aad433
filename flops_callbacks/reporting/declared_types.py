"""Whether a result read back from JSON holds the types its dataclasses declare, field by field.

A profile file edited by hand (or cut short by a tool) can hold a ``null`` or a string where a number
belongs; the dataclasses take it as given, and the renderers and comparisons then fail far from it
(``int + NoneType``), with no word of which file or field. This walk names the first such field. Why our
own: the stdlib checks no annotations at run time, and typeguard / pydantic would be the core's first
dependency beside torch; the layout needs only numbers, strings, optionals, lists, tuples, dicts and
the dataclasses and named tuples of the result.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, Literal, Union

__all__ = ["check_declared_types"]


def check_declared_types(value: Any, where: str) -> None:
    """Raise ``ValueError`` naming the first field of ``value`` (a dataclass or named tuple instance, and
    every one inside it) whose value is not of its declared type.

    Args:
        value: a dataclass or named tuple instance as read back.
        where: its name in the file, for the message (``"profile"``).
    """
    names = [f.name for f in dataclasses.fields(value)] if dataclasses.is_dataclass(value) else value._fields
    for name in names:
        found = getattr(value, name)
        declared = _hints(type(value))[name]
        path = f"{where}.{name}" if where else name
        if not _conforms(found, declared):
            raise ValueError(f"{path} is {_shown(found)}, expected {_described(declared)}")
        _check_inside(found, path)


def _named_tuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _check_inside(found: Any, path: str) -> None:
    """The dataclasses and named tuples inside a field's value: itself, or the items of its list, tuple
    or dict."""
    if (dataclasses.is_dataclass(found) and not isinstance(found, type)) or _named_tuple(found):
        check_declared_types(found, path)
    elif isinstance(found, (list, tuple)):
        for i, item in enumerate(found):
            _check_inside(item, f"{path}[{i}]")
    elif isinstance(found, dict):
        for key, item in found.items():
            _check_inside(item, f"{path}[{json.dumps(key)}]")


_HINTS: dict[type, dict[str, Any]] = {}  # each class's resolved annotations, read once


def _hints(cls: type) -> dict[str, Any]:
    found = _HINTS.get(cls)
    if found is None:
        found = _HINTS[cls] = typing.get_type_hints(cls)
    return found


def _conforms(value: Any, declared: Any) -> bool:
    origin, args = typing.get_origin(declared), typing.get_args(declared)
    if declared is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_conforms(value, a) for a in args)
    if origin is Literal:
        return value in args
    if declared is type(None):
        return value is None
    if declared is bool:
        return type(value) is bool
    if declared is int:
        return type(value) is int
    if declared is float:
        return type(value) in (int, float)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return len(value) == len(args) and all(_conforms(v, a) for v, a in zip(value, args, strict=True))
        return not args or all(_conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_conforms(v, args[1]) for v in value.values())
    if isinstance(declared, type) and issubclass(declared, tuple) and hasattr(declared, "_fields"):
        if isinstance(value, declared):  # its fields are checked by name (_check_inside)
            return True
        hints = _hints(declared)  # read back as a plain list or tuple: its items in the fields' order
        fields = [hints[name] for name in declared._fields]
        return isinstance(value, (list, tuple)) and _conforms(tuple(value), tuple[tuple(fields)])  # type: ignore[misc]
    if isinstance(declared, type):
        return isinstance(value, declared)
    return True  # a form the layout does not use: not judged


def _shown(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _described(declared: Any) -> str:
    """``int | None`` -> "an integer or null": the words a file's reader knows."""
    origin, args = typing.get_origin(declared), typing.get_args(declared)
    if origin in (Union, types.UnionType):
        return " or ".join(_described(a) for a in args)
    words = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}
    if declared in words:
        return words[declared]
    if origin in (list, tuple) or (isinstance(declared, type) and issubclass(declared, tuple)):
        return "a list"
    if origin is dict or dataclasses.is_dataclass(declared):
        return "an object"
    return str(declared)
