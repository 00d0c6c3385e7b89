"""The tool catalog (table ``tool_catalog``): tool workers publish the tools
they serve and the task queue each is served on; workflow workers read it to
pin a run's snapshot and route its tool calls (README, "Worker roles")."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import select

from roundtable.completion import complete_every_public_coroutine
from roundtable.store.database import Database
from roundtable.store.engine import database_now, insert_for
from roundtable.store.schema import ToolCatalogRow


@complete_every_public_coroutine
class ToolCatalog:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def publish(self, specs: Iterable[dict[str, Any]], task_queue: str, by: str) -> None:
        """Say that ``task_queue`` serves these tools (each a ToolSpec as JSON).
        The last worker to publish a tool names its queue: every queue ever
        named is served by the worker that named it, while it runs."""
        async with self.db.transaction() as session:
            now = await database_now(session)
            for spec in specs:
                row = {"task_queue": task_queue, "spec": spec, "published_by": by}
                await session.execute(
                    insert_for(session, ToolCatalogRow)
                    .values(name=spec["name"], published_at=now, **row)
                    .on_conflict_do_update(
                        index_elements=["name"], set_={**row, "published_at": now}
                    )
                )

    async def published(self) -> dict[str, tuple[dict[str, Any], str]]:
        """Every published tool: its spec (JSON) and the task queue serving it."""
        async with self.db.reader() as session:
            rows = (await session.execute(select(ToolCatalogRow))).scalars()
            return {row.name: (row.spec, row.task_queue) for row in rows}
