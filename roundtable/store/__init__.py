"""The Roundtable store: the single writer of every status column.

Use :func:`open_store`; it migrates the schema before handing the store out.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from roundtable.config import load_settings
from roundtable.store.engine import create_engine_for
from roundtable.store.errors import (
    AttemptMayBeRunningError,
    ConflictError,
    InvalidInputError,
    NotFoundError,
    StoreError,
)
from roundtable.store.migrate import upgrade_database
from roundtable.store.results import ToolResultOps
from roundtable.store.states import (
    FINAL_RUN_STATUSES,
    ActionStatus,
    ApprovalStatus,
    ClaimOutcome,
    RunStatus,
)

__all__ = [
    "FINAL_RUN_STATUSES",
    "ActionStatus",
    "ApprovalStatus",
    "AttemptMayBeRunningError",
    "ClaimOutcome",
    "ConflictError",
    "InvalidInputError",
    "NotFoundError",
    "RunStatus",
    "Store",
    "StoreError",
    "open_store",
]


class Store(ToolResultOps):
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
