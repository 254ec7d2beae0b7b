"""Parameters of strategies and config sections: validators whose messages say what was expected,
and the strict structuring of attrs classes from YAML values.

A strategy's ``Params`` is an attrs class whose fields use these validators; the config loader
builds it with :func:`structure`, which rejects unknown keys and wrong types ("3" is not an
integer, true is not 1) and names the key of any failure::

    configs/x.yaml: verifier.kappa: expected a number in (0, 1], got 1.5

Nothing here depends on the decode step: plugins reach these through :mod:`adaptivespec.api`.
"""

from __future__ import annotations

import types
import typing
from typing import Any

import attrs

from adaptivespec.errors import ConfigError


# -- validators whose messages say what was expected ----------------------------------------
def positive_int(inst: Any, attribute: attrs.Attribute, value: int) -> None:
    """Validator: an integer >= 1."""
    if value < 1:
        raise ValueError(f"expected a positive integer, got {value!r}")


def optional_positive_int(inst: Any, attribute: attrs.Attribute, value: int | None) -> None:
    """Validator: a positive integer, or None (YAML null)."""
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"expected a positive integer or null, got {value!r}")
    positive_int(inst, attribute, value)


def int_at_least(lo: int):
    """Validator: an integer (not a bool) ``>= lo``."""

    def check(inst: Any, attribute: attrs.Attribute, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < lo:
            raise ValueError(f"expected an integer >= {lo}, got {value!r}")

    return check


def as_tuple(value: Any) -> Any:
    """Converter: a YAML list becomes a tuple (frozen params stay hashable)."""
    return tuple(value) if isinstance(value, list) else value


def number_in(lo: float | None, hi: float | None, *, lo_open: bool = False, hi_open: bool = False):
    """Validator: ``lo <(=) value <(=) hi``; its message writes the interval."""
    text = f"{'(' if lo_open else '['}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{')' if hi_open else ']'}"

    def check(inst: Any, attribute: attrs.Attribute, value: float | None) -> None:
        if value is None:
            return
        bad = (lo is not None and (value < lo or (lo_open and value == lo))) or (
            hi is not None and (value > hi or (hi_open and value == hi))
        )
        if bad:
            raise ValueError(f"expected a number in {text}, got {value!r}")

    return check


def one_of(*choices: str):
    """Validator: one of ``choices`` (strings)."""

    def check(inst: Any, attribute: attrs.Attribute, value: str) -> None:
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {value!r}")

    return check


# -- strict structuring ------------------------------------------------------------------------
_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _describe(tp: Any) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in args)
    if typing.get_origin(tp) in (tuple, list):
        return f"a list of {_describe(args[0])}s" if args else "a list"
    if attrs.has(tp):
        return "a mapping"
    return _TYPE_WORDS.get(tp, getattr(tp, "__name__", str(tp)))


def _convert(tp: Any, value: Any, where: str, key: str) -> Any:
    """``value`` as type ``tp`` (no lenient coercion: "3" is not an int, true is not 1)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner_error = None
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(a, value, where, key)
            except ConfigError as exc:
                if attrs.has(a) and isinstance(value, dict):  # the mapping's own error says more
                    inner_error = exc
        if inner_error is not None:
            raise inner_error
    elif origin in (tuple, list) and isinstance(value, (list, tuple)):
        inner = args[0] if args else Any
        items = [_convert(inner, v, where, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    elif tp is bool and isinstance(value, bool):
        return value
    elif tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return value  # ints stay as written so messages echo the user's value
    elif tp is str and isinstance(value, str):
        return value
    elif attrs.has(tp) and isinstance(value, dict):
        return structure(tp, value, where, key)
    raise ConfigError(where, key, f"expected {_describe(tp)}, got {value!r}")


def structure(cls: type, data: Any, where: str, path: str) -> Any:
    """Build attrs class ``cls`` from a mapping, rejecting unknown keys and wrong types."""
    fields = {f.name: f for f in attrs.fields(attrs.resolve_types(cls))}
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(where, path, f"expected a mapping, got {data!r}")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = f"{path}.{unknown[0]}" if path else str(unknown[0])
        raise ConfigError(where, key, f"unknown key; expected one of: {', '.join(fields) or '(no keys)'}")
    missing = [n for n, f in fields.items() if f.default is attrs.NOTHING and f.init and n not in data]
    if missing:
        key = f"{path}.{missing[0]}" if path else missing[0]
        raise ConfigError(where, key, "required key missing")
    kwargs = {name: _convert(fields[name].type, value, where, f"{path}.{name}" if path else name) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        # attrs validators name the attribute in their own message; find which key it was
        bad = next((n for n in kwargs if f"'{n}'" in str(exc) or str(exc).startswith(n)), None)
        failing = _failing_key(cls, kwargs) or bad
        key = f"{path}.{failing}" if failing and path else (failing or path)
        message = str(exc)
        if failing and message.startswith(f"{failing}: "):  # the key is already in front
            message = message[len(failing) + 2:]
        raise ConfigError(where, key, message) from None


def _failing_key(cls: type, kwargs: dict[str, Any]) -> str | None:
    """Re-run field validators one by one to find which key a failure belongs to."""
    for f in attrs.fields(cls):
        if f.name in kwargs and f.validator is not None:
            try:
                f.validator(None, f, kwargs[f.name])
            except (ValueError, TypeError):
                return f.name
    return None
