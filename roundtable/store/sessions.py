"""Sessions: the task a user brings; each run belongs to one."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from roundtable.completion import complete_every_public_coroutine
from roundtable.states import RunStatus
from roundtable.store.core_statements import CoreConnection
from roundtable.store.core_writes import insert_into, write_later
from roundtable.store.database import Database
from roundtable.store.engine import database_now
from roundtable.store.errors import InvalidInputError
from roundtable.store.rows import new_id, require_text
from roundtable.store.schema import SessionRow
from roundtable.store.text import refuse_unstorable

_SESSIONS = SessionRow.__table__


def check_session(user_id: str, task_text: str) -> None:
    """A new session's fields, checked before anything is written."""
    require_text("user_id", user_id)
    if not isinstance(task_text, str):
        raise InvalidInputError("task_text must be a string", field="task_text")
    refuse_unstorable("task_text", task_text)


async def insert_session(connection: CoreConnection, user_id: str, task_text: str) -> dict:
    """A new session (fields checked by :func:`check_session`), in the
    caller's transaction; its row as row_to_dict gives it."""
    now = await database_now(connection)
    row = {
        "id": new_id(),
        "user_id": user_id,
        "task_text": task_text,
        "status": RunStatus.PENDING,
        "created_at": now,
        "updated_at": now,
    }
    await write_later(connection, insert_into(_SESSIONS), row)
    return row


@complete_every_public_coroutine
class Sessions:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def create(self, *, user_id: str, task_text: str) -> dict[str, Any]:
        check_session(user_id, task_text)
        async with self.db.core_transaction() as (connection, _):
            return await insert_session(connection, user_id, task_text)

    async def get(self, session_id: str) -> dict[str, Any]:
        return await self.db.get(SessionRow, session_id)

    async def list(self, *, user_id: str | None = None) -> list[dict[str, Any]]:
        query = select(SessionRow).order_by(SessionRow.created_at, SessionRow.id)
        if user_id is not None:
            query = query.where(SessionRow.user_id == user_id)
        return await self.db.all(query)
