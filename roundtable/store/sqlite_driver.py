"""aiosqlite with one trip to its thread per statement, not four.

aiosqlite runs every sqlite3 call on a thread of its own and hands each
result back to the event loop. SQLAlchemy's adapter makes four such calls
per statement: open a cursor, execute, fetch the rows, close the cursor.
Each trip wakes the event loop, resolves a future and switches greenlets,
and that machinery, not SQLite, was most of the store's CPU (bench/README,
"Where the time goes now"). Here the cursor does all four in one trip: the
rows, description, row count and last row id are read on the thread and
kept, and the fetches that follow return them without a trip.

What does not change: every sqlite3 call still runs on the connection's own
thread, in order, through aiosqlite's queue (``Connection._execute``), so
transactions, errors and the writer lock behave as before; commit, rollback
and close are aiosqlite's own. This relies on aiosqlite's ``Connection``
constructor and ``_execute``, which is why pyproject pins aiosqlite's
minor version; ``tests/test_sqlite_driver.py`` checks the cursor's contract.
"""

from __future__ import annotations

import sqlite3
from functools import partial
from typing import Any

import aiosqlite.core

_ITER_CHUNK_SIZE = 64  # aiosqlite's default; unused here (rows come all at once)


class OneTripCursor:
    """The part of aiosqlite's cursor SQLAlchemy's adapter uses."""

    def __init__(self, connection: OneTripConnection) -> None:
        self._connection = connection
        self._rows: list[Any] = []
        self.description: Any = None
        self.rowcount = -1
        self.lastrowid: int | None = None
        self.arraysize = 1

    def _run(self, method: str, sql: str, parameters: Any) -> None:
        """On the connection's thread: the statement, all its rows, and the
        cursor closed, so no statement is left half-stepped."""
        # Nothing of a previous statement outlives this one, even if it fails
        # (SQLAlchemy runs several statements on one cursor: insertmanyvalues,
        # the connect pragmas); as sqlite3's cursor, which resets these.
        self._rows = []
        self.description = None
        self.rowcount = -1
        cursor = self._connection._conn.cursor()
        try:
            getattr(cursor, method)(sql, parameters)
            self.description = cursor.description
            self._rows = cursor.fetchall() if cursor.description else []
            self.rowcount = cursor.rowcount
            self.lastrowid = cursor.lastrowid
        finally:
            cursor.close()

    async def execute(self, sql: str, parameters: Any = None) -> OneTripCursor:
        # None only, as aiosqlite: an empty dict stays a dict, so a statement
        # with named parameters fails with sqlite3's own message for it.
        if parameters is None:
            parameters = ()
        await self._connection._execute(self._run, "execute", sql, parameters)
        return self

    async def executemany(self, sql: str, parameters: Any) -> OneTripCursor:
        await self._connection._execute(self._run, "executemany", sql, parameters)
        return self

    async def fetchall(self) -> list[Any]:
        rows, self._rows = self._rows, []
        return rows

    async def fetchone(self) -> Any:
        return self._rows.pop(0) if self._rows else None

    async def fetchmany(self, size: int | None = None) -> list[Any]:
        count = self.arraysize if size is None else size
        rows, self._rows = self._rows[:count], self._rows[count:]
        return rows

    async def close(self) -> None:
        self._rows = []

    async def __aenter__(self) -> OneTripCursor:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()


class OneTripConnection(aiosqlite.core.Connection):
    def cursor(self) -> OneTripCursor:  # type: ignore[override]
        # No trip: the sqlite3 cursor is made on the thread, per statement.
        return OneTripCursor(self)


def connect(database: str, **kwargs: Any) -> OneTripConnection:
    """As ``aiosqlite.connect``, for SQLAlchemy's ``async_creator_fn``: it
    receives the arguments the dialect would have given aiosqlite."""
    connection = OneTripConnection(partial(sqlite3.connect, database, **kwargs), _ITER_CHUNK_SIZE)
    # As SQLAlchemy does for aiosqlite's own: the thread must not keep a
    # process alive that forgot to dispose of its engine.
    connection._thread.daemon = True
    return connection
