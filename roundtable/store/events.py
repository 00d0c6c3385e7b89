"""A run's audit log, read back: every event, a page of them, the chain checked."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from roundtable.completion import complete_every_public_coroutine
from roundtable.store.audit import GENESIS_HASH, verify_chain
from roundtable.store.database import Database
from roundtable.store.rows import numbered_after, row_to_dict
from roundtable.store.schema import AuditEventRow, RunRow


@complete_every_public_coroutine
class Events:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def list(self, run_id: str) -> list[dict[str, Any]]:
        return await self.db.all(
            select(AuditEventRow).where(AuditEventRow.run_id == run_id).order_by(AuditEventRow.seq)
        )

    async def page(
        self, run_id: str, *, after_seq: int | None = None, limit: int | None = None
    ) -> list[dict[str, Any]]:
        """A run's audit events in sequence order, after ``after_seq``."""
        query = select(AuditEventRow).where(AuditEventRow.run_id == run_id)
        query = numbered_after(query, AuditEventRow.seq, after_seq, limit)
        async with self.db.snapshot() as session:
            return [row_to_dict(r) for r in (await session.execute(query)).scalars()]

    async def verify_chain(self, run_id: str) -> bool:
        """Recompute the run's hash chain; False means the log was altered."""
        events = await self.list(run_id)
        run = await self.db.get(RunRow, run_id)
        head = events[-1]["hash"] if events else GENESIS_HASH
        return verify_chain(events) and head == run["last_event_hash"]
