"""Sessions: the task a user brings; each run belongs to one."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from roundtable.completion import complete_every_public_coroutine
from roundtable.states import RunStatus
from roundtable.store.database import Database
from roundtable.store.engine import database_now
from roundtable.store.errors import InvalidInputError
from roundtable.store.rows import new_id, require_text, row_to_dict
from roundtable.store.schema import SessionRow
from roundtable.store.text import refuse_unstorable


@complete_every_public_coroutine
class Sessions:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def create(self, *, user_id: str, task_text: str) -> dict[str, Any]:
        require_text("user_id", user_id)
        if not isinstance(task_text, str):
            raise InvalidInputError("task_text must be a string", field="task_text")
        refuse_unstorable("task_text", task_text)
        async with self.db.transaction() as session:
            now = await database_now(session)
            row = SessionRow(
                id=new_id(),
                user_id=user_id,
                task_text=task_text,
                status=RunStatus.PENDING,
                created_at=now,
                updated_at=now,
            )
            session.add(row)
        return row_to_dict(row)

    async def get(self, session_id: str) -> dict[str, Any]:
        return await self.db.get(SessionRow, session_id)

    async def list(self, *, user_id: str | None = None) -> list[dict[str, Any]]:
        query = select(SessionRow).order_by(SessionRow.created_at, SessionRow.id)
        if user_id is not None:
            query = query.where(SessionRow.user_id == user_id)
        return await self.db.all(query)
