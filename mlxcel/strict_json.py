"""Strict JSON fields: the type and bound checks every hand-written codec of mlxcel shares.

A JSON boolean is never an integer or a number, a float is never an integer, a number is finite, a
string's bound is in characters or in UTF-8 bytes. A failed check raises ``FieldError`` (a
``ValueError``) naming the field; each codec maps it to its documented error (``MessageRefused``,
``ControlError``, ``ProtocolError``, ...). A refusal's text is a ``str.format`` template over ``name``,
``lo``, ``hi``, ``limit`` and ``value`` (``'nothing'`` for an absent field), so each protocol keeps its
own wording. No MLX and no feature imports here: every layer may use it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

INT_TEXT = "{name} must be an integer in {lo}..{hi}, got {value!r}"
NUMBER_TEXT = "{name} must be a finite number, got {value!r}"
BOOL_TEXT = "{name} must be true or false, got {value!r}"
STRING_TEXT = "{name} must be a string of at most {limit} characters"


class _Absent:
    """The value of a missing field: every check refuses it, a refusal's text reads it as 'nothing'."""

    def __repr__(self) -> str:
        return "'nothing'"


ABSENT: Any = _Absent()


class FieldError(ValueError):
    """A field is absent, mistyped or out of its bounds; ``name`` is the field, the text says why."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


def refuse(name: str, text: str, value: Any, **bounds: Any) -> FieldError:
    """The ``FieldError`` of ``text`` (a template) for field ``name`` holding ``value``."""
    return FieldError(name, text.format(name=name, value=value, **bounds))


def mapped(make: Callable[[FieldError], Exception]) -> Callable[[F], F]:
    """A decorator: a ``FieldError`` raised inside becomes ``make(error)`` (a codec's documented error)."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except FieldError as exc:
                raise make(exc) from None
        return call  # type: ignore[return-value]
    return wrap


# -- predicates --------------------------------------------------------------------------------------


def is_int(value: Any) -> bool:
    """A JSON integer (``true`` is not 1, ``1.0`` is not 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite JSON number, integer or float (``true`` is not 1.0)."""
    return (is_int(value) or isinstance(value, float)) and value == value and abs(value) != float("inf")


def in_range(value: Any, lo: int | None = None, hi: int | None = None) -> bool:
    """An integer in [lo, hi] (a bound that is None is open)."""
    return is_int(value) and (lo is None or value >= lo) and (hi is None or value <= hi)


def utf8_len(text: str, *, lone_surrogates: bool = False) -> int | None:
    """``text``'s length in UTF-8 bytes; None when it holds a lone surrogate (JSON ``"\\ud800"``), unless
    ``lone_surrogates`` counts each as one byte (the replacement ``?``)."""
    try:
        return len(text.encode("utf-8", "replace" if lone_surrogates else "strict"))
    except UnicodeEncodeError:
        return None


def is_string(value: Any, *, min_len: int = 0, max_chars: int | None = None, max_bytes: int | None = None,
              lone_surrogates: bool = False) -> bool:
    """A string of at least ``min_len`` characters, at most ``max_chars`` characters and ``max_bytes`` UTF-8 bytes."""
    if not isinstance(value, str) or len(value) < min_len or (max_chars is not None and len(value) > max_chars):
        return False
    if max_bytes is None:
        return True
    size = utf8_len(value, lone_surrogates=lone_surrogates)
    return size is not None and size <= max_bytes


def unknown_keys(doc: dict[str, Any], allowed: Iterable[str]) -> list[str]:
    """The keys of ``doc`` outside ``allowed``, sorted (an unknown key is refused, never ignored)."""
    return sorted(set(doc) - set(allowed))


# -- checks: the value, or FieldError ------------------------------------------------------------------


def integer(value: Any, name: str, lo: int | None = None, hi: int | None = None, *, text: str = INT_TEXT) -> int:
    if not in_range(value, lo, hi):
        raise refuse(name, text, value, lo=lo, hi=hi)
    return value


def number(value: Any, name: str, *, text: str = NUMBER_TEXT) -> float:
    if not is_number(value):
        raise refuse(name, text, value)
    return float(value)


def boolean(value: Any, name: str, *, text: str = BOOL_TEXT) -> bool:
    if not isinstance(value, bool):
        raise refuse(name, text, value)
    return value


def string(value: Any, name: str, *, min_len: int = 0, max_chars: int | None = None, max_bytes: int | None = None,
           lone_surrogates: bool = False, text: str = STRING_TEXT) -> str:
    if not is_string(value, min_len=min_len, max_chars=max_chars, max_bytes=max_bytes, lone_surrogates=lone_surrogates):
        raise refuse(name, text, value, limit=max_bytes if max_bytes is not None else max_chars)
    return value


def strings(value: Any, name: str, *, max_chars: int | None = None, text: str) -> tuple[str, ...]:
    """A list of strings, each of at most ``max_chars`` characters."""
    if not isinstance(value, list) or not all(is_string(s, max_chars=max_chars) for s in value):
        raise refuse(name, text, value, limit=max_chars)
    return tuple(value)


_CHECKS: dict[type, Callable[..., Any]] = {int: integer, float: number, bool: boolean, str: string, tuple: strings}


def field(doc: dict[str, Any], name: str, kind: type, *, default: Any = ABSENT, optional: bool = False,
          **bounds: Any) -> Any:
    """``doc[name]`` checked as ``kind`` (int, float, bool, str, or tuple: a list of strings) with ``bounds``
    (``lo``/``hi``, ``min_len``/``max_chars``/``max_bytes``, ``text``). Absent: ``default``, refused when there
    is none; null (or absent without a default): None when ``optional``, else checked like any other value."""
    value = doc.get(name, default)
    if optional and (value is None or value is ABSENT):
        return None
    return _CHECKS[kind](value, name, **bounds)
