"""A tool's answer as the JSON object a write's result is, before redaction.

A handler is to answer with a JSON object, but one that answered otherwise
still ran to its end: its write is done, and failing the record over the
answer's shape would leave it for an operator to reconcile as ``unknown``.
So the answer is rebuilt as plain JSON, value by value, keeping its
structure, because the redactor works on structure: a value under a key
named after a secret argument is hidden whatever its length, and a number
equal to a secret is hidden by value. Flattening a whole answer to its text
lost both (found by the review of the first version, which did).

- Mappings of any kind become dicts, their keys text (numbered where two
  keys come out alike); lists, tuples and sets become lists.
- Subclasses of str, int and float become the plain value they hold (their
  own methods are not asked); a Decimal becomes the number it is; bytes the
  UTF-8 text they spell (undecodable bytes as ``\\xNN``), so the redactor
  meets a secret echoed as bytes in its own spelling.
- An int too long for decimal text is kept in hex; a cycle is cut where it
  comes back, as ``<cycle>``; nesting deeper than ``DEEPEST`` as
  ``<nested too deep>``; anything else as its text.

An answer that holds work not yet done (a coroutine or task it did not
await, a future, a generator) is not an answer: the write may still be
under way, or never run. :class:`UnfinishedAnswer` says so, and the write is
``unknown`` with its lease left to run out, as before this module, when such
an answer failed the record.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import inspect
import math
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

DEEPEST = 64
# Python refuses decimal text of an int past 4,300 digits (about 14,284 bits).
_LONGEST_DECIMAL_BITS = 14_000


class UnfinishedAnswer(Exception):
    """The answer holds work not yet done: the write may still be under way."""

    def __init__(self, kind: str) -> None:
        super().__init__(f"the tool answered with a {kind}, not with what it did")
        self.kind = kind


def json_object(answer: Any) -> dict[str, Any] | None:
    """``answer`` as a JSON object (another JSON value kept under ``value``),
    or None for no answer; :class:`UnfinishedAnswer` when it holds work not
    yet done."""
    if answer is None:
        return None
    plain = _plain(answer, set(), 0)
    return plain if isinstance(plain, dict) else {"value": plain}


def _plain(value: Any, path: set[int], depth: int) -> Any:
    if value is None or isinstance(value, bool):
        return value
    _refuse_unfinished(value)
    if isinstance(value, int):
        return _whole(int.__int__(value))
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Decimal):
        return _decimal(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", "backslashreplace")
    if not isinstance(value, Mapping | list | tuple | set | frozenset):
        return _text_of(value)
    if id(value) in path:
        return "<cycle>"
    if depth >= DEEPEST:
        return "<nested too deep>"
    path.add(id(value))
    try:
        if isinstance(value, Mapping):
            return _object(value, path, depth + 1)
        return [_plain(item, path, depth + 1) for item in value]
    except UnfinishedAnswer:
        raise
    except Exception:  # a container that fails to be walked: its text, not a lost write
        return _text_of(value)
    finally:
        path.discard(id(value))


def _object(mapping: Mapping[Any, Any], path: set[int], depth: int) -> dict[str, Any]:
    plain: dict[str, Any] = {}
    for key, item in mapping.items():
        name = _key(key)
        taken, n = name, 1
        while taken in plain:
            n += 1
            taken = f"{name} ({n})"
        plain[taken] = _plain(item, path, depth)
    return plain


def _key(key: Any) -> str:
    if isinstance(key, str):
        return str.__str__(key)
    if isinstance(key, bytes):
        return key.decode("utf-8", "backslashreplace")
    return _text_of(key)


def _whole(number: int) -> int | str:
    if number.bit_length() > _LONGEST_DECIMAL_BITS:
        return f"{number:#x}"
    return number


def _decimal(number: Decimal) -> int | float | str:
    if number.is_nan():
        return math.nan
    if number.is_infinite():
        return math.inf if number > 0 else -math.inf
    if number == number.to_integral_value():
        return _whole(int(number))
    return float(number)


def _refuse_unfinished(value: Any) -> None:
    if inspect.iscoroutine(value) or inspect.isgenerator(value):
        # Never started, and now never will: no warning that it was not awaited.
        with contextlib.suppress(Exception):
            value.close()
    elif not (
        inspect.isawaitable(value)
        or inspect.isasyncgen(value)
        or isinstance(value, concurrent.futures.Future)
    ):
        return
    raise UnfinishedAnswer(type(value).__name__)


def _text_of(value: Any) -> str:
    try:
        return str(value)
    except Exception:  # a tool's object whose text fails: say what it was
        return f"<{type(value).__name__}>"
