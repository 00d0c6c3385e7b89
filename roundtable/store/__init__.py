"""The Roundtable store: the single writer of every status column.

Use :func:`open_store`; it migrates the schema before handing the store out.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from roundtable.config import load_settings
from roundtable.store.engine import create_engine_for
from roundtable.store.errors import ConflictError, InvalidInputError, NotFoundError, StoreError
from roundtable.store.migrate import upgrade_database
from roundtable.store.states import (
    ActionStatus,
    ApprovalStatus,
    ClaimOutcome,
    RunStatus,
)
from roundtable.store.webhooks import WebhookOps

__all__ = [
    "ActionStatus",
    "ApprovalStatus",
    "ClaimOutcome",
    "ConflictError",
    "InvalidInputError",
    "NotFoundError",
    "RunStatus",
    "Store",
    "StoreError",
    "open_store",
]


class Store(WebhookOps):
    """Sessions, runs, actions, approvals, leases and audit; every method is one
    or more atomic transactions and returns plain dicts or outcome strings."""


@asynccontextmanager
async def open_store(database_url: str | None = None) -> AsyncIterator[Store]:
    """Open the database at ``database_url`` (default: settings), migrate it to
    the newest schema, and yield the store; the engine is disposed on exit."""
    engine = create_engine_for(database_url or load_settings().database_url)
    try:
        await upgrade_database(engine)
        yield Store(engine)
    finally:
        await engine.dispose()
