"""The Roundtable store: the single writer of every status column.

Use :func:`open_store`; it migrates the schema before handing the store out.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from roundtable.completion import complete_every_public_coroutine
from roundtable.config import load_settings
from roundtable.store.core import RunGrant
from roundtable.store.engine import create_engine_for
from roundtable.store.errors import (
    AttemptMayBeRunningError,
    ConflictError,
    ForbiddenError,
    InvalidInputError,
    NotFoundError,
    StoreError,
)
from roundtable.store.migrate import upgrade_database
from roundtable.store.reads import ReadOps
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
    "ForbiddenError",
    "InvalidInputError",
    "NotFoundError",
    "RunGrant",
    "RunStatus",
    "Store",
    "StoreError",
    "open_store",
]


@complete_every_public_coroutine
class Store(ReadOps, ToolResultOps):
    """Sessions, runs, actions, approvals, leases and audit; every method is one
    or more atomic transactions and returns plain dicts or outcome strings.

    A caller cancelled mid-call (an activity cancelled, a timeout) never
    abandons a database call half-way: the call runs to its own end first,
    then the cancellation goes on. Abandoned mid-transaction, an aiosqlite
    connection was seen to keep SQLite's write lock for a minute, stalling
    every writer (test_store_cancellation.py)."""


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
