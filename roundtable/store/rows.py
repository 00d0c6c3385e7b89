"""Rows in and out: ids, plain dicts, input checks and keyset paging."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import and_, or_

from roundtable.store.errors import InvalidInputError
from roundtable.store.schema import Base
from roundtable.store.text import refuse_unstorable


def row_to_dict(row: Base) -> dict[str, Any]:
    return {column.key: getattr(row, column.key) for column in row.__table__.columns}


def new_id() -> str:
    return str(uuid.uuid4())


def require_text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidInputError(f"{name} must be a non-empty string", field=name)
    return refuse_unstorable(name, value)


def require_aware(name: str, value: Any) -> datetime:
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise InvalidInputError(f"{name} must be a timezone-aware datetime")
    return value


def page_after(query: Any, row: Any, after: tuple[datetime, str] | None, limit: int | None) -> Any:
    """Keyset paging over rows ordered by (created_at, id): those after the
    last one seen, at most ``limit``."""
    if after is not None:
        created, last_id = after
        query = query.where(
            or_(row.created_at > created, and_(row.created_at == created, row.id > last_id))
        )
    return query if limit is None else query.limit(limit)


def numbered_after(query: Any, column: Any, after: int | None, limit: int | None) -> Any:
    """Rows ordered by a growing number (audit seq, delivery id), after ``after``."""
    if after is not None:
        query = query.where(column > after)
    query = query.order_by(column)
    return query if limit is None else query.limit(limit)
