"""The webhook delivery log: one row per attempt, so an operator can see what
each receiver was sent, when, and what it answered."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from roundtable.store.engine import database_now
from roundtable.store.schema import WebhookDeliveryRow
from roundtable.store.tokens import TokenOps


class WebhookOps(TokenOps):
    async def record_webhook_attempt(self, **fields: Any) -> None:
        async with self._transaction() as session:
            session.add(WebhookDeliveryRow(created_at=await database_now(session), **fields))

    async def list_webhook_deliveries(self, run_id: str | None = None) -> list[dict[str, Any]]:
        query = select(WebhookDeliveryRow).order_by(WebhookDeliveryRow.id)
        if run_id is not None:
            query = query.where(WebhookDeliveryRow.run_id == run_id)
        return await self._all(query)
