"""Text PostgreSQL cannot store: NUL bytes and lone surrogates.

PostgreSQL refuses NUL in ``text`` and ``\\u0000`` in ``jsonb``; asyncpg
refuses to encode lone surrogates. SQLite stores all three, so the same input
worked on one database and was a raw error (a 500, a failed activity) on the
other. Both databases now behave alike:

* what callers send (task text, user ids, reasons, notes, ids in lookups) is
  refused as :class:`InvalidInputError`, naming the field;
* what models and tools produce reaches JSON columns and audit payloads
  escaped, as visible text (NUL becomes the six characters ``\\u0000``), so a
  run goes on and nothing is silently dropped.

Numbers too (found by the review of the Core decision and outcome): ``jsonb``
refuses NaN and ±Infinity, which Python's json writes, so a tool's result
holding one lost its succeeded write on PostgreSQL alone; they are kept as
the strings JSON's own spelling gives them. And ``jsonb`` keeps a number as
numeric, so a float written with an exponent and no fraction (``1e+16``)
came back an integer: the audit event's hash, taken over what was written,
no longer matched what was read, and the chain failed to verify. Such a
float is written as the integer it is.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from roundtable.store.errors import InvalidInputError

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def unstorable(value: str) -> bool:
    return _UNSTORABLE.search(value) is not None


def escape_text(value: str) -> str:
    """NUL and surrogates as ``\\uXXXX`` text; anything else unchanged."""
    if not unstorable(value):
        return value
    return _UNSTORABLE.sub(lambda m: f"\\u{ord(m.group()):04x}", value)


_NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


def _storable_number(value: float) -> float | int | str:
    """NaN and ±Infinity as strings; an integral float that JSON would write
    with an exponent (``1e+16``) as the integer, which every database gives
    back as written."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return _NON_FINITE[value]
    if value.is_integer() and "e" in repr(value):
        return int(value)
    return value


def escape_json(value: Any) -> Any:
    """``value`` with every string (keys too) escaped and every number made
    storable as written (:func:`_storable_number`), at any depth."""
    if isinstance(value, str):
        return escape_text(value)
    if isinstance(value, float):
        return _storable_number(value)
    if isinstance(value, Mapping):
        return {
            escape_text(k) if isinstance(k, str) else k: escape_json(v) for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [escape_json(v) for v in value]
    return value


def dumps_storable(value: Any) -> str:
    """The engines' JSON serializer: JSON columns always get storable text."""
    return json.dumps(escape_json(value))


def as_stored(value: Any) -> Any:
    """A JSON column's value as the database gives it back once written
    (PostgreSQL's jsonb may order an object's keys otherwise: equal as
    values), without reading it."""
    return json.loads(dumps_storable(value))


def refuse_unstorable(name: str, value: Any) -> Any:
    """Caller input: refused, never altered (what was asked must be what is kept)."""
    if isinstance(value, str) and unstorable(value):
        raise InvalidInputError(
            f"{name} must not contain NUL bytes or unpaired surrogates", field=name
        )
    return value


def check_parameters(parameters: Any) -> None:
    """Backstop before any statement runs: a text parameter the database
    cannot take is the caller's bad input (an id with NUL in a lookup), not a
    database failure. ``parameters`` are what the driver is handed: JSON
    values are already serialized (and escaped) by then, so only raw text
    is refused."""
    rows = parameters if isinstance(parameters, list) else [parameters]
    for row in rows:
        values = row.values() if isinstance(row, Mapping) else row
        for value in values if isinstance(values, list | tuple | type({}.values())) else []:
            if isinstance(value, str) and unstorable(value):
                # Parameter names (pk_1, id_2) would mean nothing to a caller.
                raise InvalidInputError("text must not contain NUL bytes or unpaired surrogates")
