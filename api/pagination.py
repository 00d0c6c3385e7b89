"""Opaque cursors for every paged list: one format, one decoder, one error.

A cursor is the sort key of the last row a page returned, base64url-encoded.
Lists ordered by (created_at, id) use a time cursor; lists ordered by a number
(audit sequence, delivery id) use a number cursor. Whatever a caller sends is
checked here, so a forged cursor is a 422 problem, never a database error.
"""

from __future__ import annotations

import base64
import binascii
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import Query

from api.problems import Problem

DEFAULT_LIMIT = 50
MAX_LIMIT = 200

Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT, description="Items per page.")]
Cursor = Annotated[
    str | None,
    Query(max_length=512, description="The next_cursor of the previous page."),
]


def encode_cursor(*parts: object) -> str:
    raw = "|".join(p.isoformat() if isinstance(p, datetime) else str(p) for p in parts)
    return base64.urlsafe_b64encode(raw.encode()).decode()


def _invalid(cause: Exception | None = None) -> Problem:
    problem = Problem(
        422,
        "validation_error",
        "cursor: not a cursor this API gave out",
        errors=[{"field": "cursor", "message": "invalid cursor"}],
    )
    problem.__cause__ = cause
    return problem


def _parts(cursor: str, count: int) -> list[str]:
    try:
        raw = base64.urlsafe_b64decode(cursor.encode("ascii")).decode("utf-8")
    except (ValueError, UnicodeError, binascii.Error) as exc:
        raise _invalid(exc) from exc
    parts = raw.split("|", count - 1)
    # NUL or surrogates could never be in a cursor we gave out (ids are plain).
    if len(parts) != count or any(not p or "\x00" in p for p in parts):
        raise _invalid()
    return parts


def after_time(cursor: str | None) -> tuple[datetime, str] | None:
    """(created_at, id) of the last row seen; the time must carry its zone,
    since a naive one cannot be compared with stored (aware) times."""
    if not cursor:
        return None
    created, row_id = _parts(cursor, 2)
    try:
        when = datetime.fromisoformat(created)
    except ValueError as exc:
        raise _invalid(exc) from exc
    if when.tzinfo is None or when.utcoffset() is None:
        raise _invalid()
    try:  # 0001-01-01+14:00 is a valid time that UTC cannot hold
        return when.astimezone(UTC), row_id
    except OverflowError as exc:
        raise _invalid(exc) from exc


def after_number(cursor: str | None) -> int | None:
    """The sequence number or id of the last row seen."""
    if not cursor:
        return None
    (number,) = _parts(cursor, 1)
    if not number.isascii() or not number.isdigit() or len(number) > 18:
        raise _invalid()
    return int(number)


def page(items: list[Any], limit: int, last_key: tuple[object, ...] | None) -> dict[str, Any]:
    """A page body: a full page may have more after it, so it carries a cursor."""
    more = len(items) == limit and last_key is not None
    return {"items": items, "next_cursor": encode_cursor(*last_key) if more else None}
