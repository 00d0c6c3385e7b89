"""The webhook delivery log: one row per attempt, so an operator can see what
each receiver was sent, when, and what it answered."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from roundtable.completion import complete_every_public_coroutine
from roundtable.store.database import Database
from roundtable.store.engine import database_now
from roundtable.store.rows import numbered_after, row_to_dict
from roundtable.store.schema import WebhookDeliveryRow


@complete_every_public_coroutine
class Webhooks:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def record_attempt(self, **fields: Any) -> None:
        async with self.db.transaction() as session:
            session.add(WebhookDeliveryRow(created_at=await database_now(session), **fields))

    async def list(self, run_id: str | None = None) -> list[dict[str, Any]]:
        query = select(WebhookDeliveryRow).order_by(WebhookDeliveryRow.id)
        if run_id is not None:
            query = query.where(WebhookDeliveryRow.run_id == run_id)
        return await self.db.all(query)

    async def page(
        self, *, run_id: str | None = None, after_id: int | None = None, limit: int | None = None
    ) -> list[dict[str, Any]]:
        """Delivery attempts in the order they were made, after ``after_id``."""
        query = select(WebhookDeliveryRow)
        if run_id is not None:
            query = query.where(WebhookDeliveryRow.run_id == run_id)
        query = numbered_after(query, WebhookDeliveryRow.id, after_id, limit)
        async with self.db.snapshot() as session:
            return [row_to_dict(r) for r in (await session.execute(query)).scalars()]
