"""aiosqlite with one trip to its thread per statement, not four.

aiosqlite runs every sqlite3 call on a thread of its own and hands each
result back to the event loop. SQLAlchemy's adapter makes four such calls
per statement: open a cursor, execute, fetch the rows, close the cursor.
Each trip wakes the event loop, resolves a future and switches greenlets,
and that machinery, not SQLite, was most of the store's CPU (bench/README,
"Where the time goes now"). Here the cursor does all four in one trip: the
rows, description, row count and last row id are read on the thread and
kept, and the fetches that follow return them without a trip.

Two more trips per transaction are saved where nothing can differ:

- A ``BEGIN`` goes with the statement after it, in its trip. It is held
  back only on a connection known to be idle outside a transaction, so the
  ``BEGIN`` cannot fail for a transaction left open; if it fails otherwise
  (the write lock's busy timeout) that error is the statement's, and the
  statement is not run. A transaction with no statement sends nothing. A
  call of aiosqlite's own (``execute``, ``executemany``, ...) takes the held
  ``BEGIN`` with it too, so it runs inside the transaction, as before.
- A rollback on a connection known to be idle outside a transaction is not
  sent: the pool's rollback when a connection is returned after its commit,
  or a second rollback. "Known" means the last call queued for the thread was
  a commit or rollback that completed, no transaction open, and nothing was
  queued since (counted: another task's call queued while the end ran, on a
  connection two tasks share, leaves it unknown); any other call, or a call
  cancelled or failed, forgets it, and the rollback is sent as before (queued
  behind whatever the thread still runs).

A transaction's last statement may also take the commit with it
(``run_steps(..., commit=True)``, sqlite_core's ``execute_and_commit``): one
trip for BEGIN, statement and COMMIT, the connection known idle after it.

What does not change: every sqlite3 call still runs on the connection's own
thread, in order, through aiosqlite's queue (``Connection._execute``), so
transactions, errors and the writer lock behave as before; close is
aiosqlite's own. This relies on aiosqlite's ``Connection``
constructor and ``_execute``, which is why pyproject pins aiosqlite's
minor version; ``tests/test_sqlite_driver.py`` checks the cursor's contract.
"""

from __future__ import annotations

import sqlite3
from functools import partial
from typing import Any

import aiosqlite.core

_ITER_CHUNK_SIZE = 64  # aiosqlite's default; unused here (rows come all at once)
# The statements that open a transaction (the engine sends the first two).
_BEGINS = frozenset({"BEGIN", "BEGIN IMMEDIATE", "BEGIN DEFERRED", "BEGIN EXCLUSIVE"})


class OneTripCursor:
    """The part of aiosqlite's cursor SQLAlchemy's adapter uses."""

    def __init__(self, connection: OneTripConnection) -> None:
        self._connection = connection
        self._rows: list[Any] = []
        self.description: Any = None
        self.rowcount = -1
        self.lastrowid: int | None = None
        self.arraysize = 1

    def _reset(self) -> None:
        # Nothing of a previous statement outlives this one, even if it fails
        # (SQLAlchemy runs several statements on one cursor: insertmanyvalues,
        # the connect pragmas); as sqlite3's cursor, which resets these.
        self._rows = []
        self.description = None
        self.rowcount = -1

    def _run(self, method: str, sql: str, parameters: Any, begin: str | None) -> None:
        """On the connection's thread: the held-back BEGIN if any, the
        statement, all its rows, and the cursor closed, so no statement is
        left half-stepped."""
        self._reset()
        if begin is not None:
            self._connection._open(begin)
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
        if not parameters and self._connection._hold_begin(sql):
            self._reset()
            return self
        begin = self._connection._take_begin()
        await self._connection._execute(self._run, "execute", sql, parameters, begin)
        return self

    async def executemany(self, sql: str, parameters: Any) -> OneTripCursor:
        begin = self._connection._take_begin()
        await self._connection._execute(self._run, "executemany", sql, parameters, begin)
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
    # A BEGIN not sent yet: it goes with the next statement.
    _begin: str | None = None
    # The thread is idle and its connection holds no transaction (see the
    # module's docstring for when this is known).
    _idle_outside_transaction = False
    # Calls queued for the thread so far: an end knows the state it found
    # only if nothing was queued after it.
    _queued = 0

    def cursor(self) -> OneTripCursor:  # type: ignore[override]
        # No trip: the sqlite3 cursor is made on the thread, per statement.
        return OneTripCursor(self)

    async def _execute(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # Forgotten before anything is queued: a call cancelled or failed
        # leaves the thread's state unknown.
        self._idle_outside_transaction = False
        self._queued += 1
        begin = self._take_begin()
        if begin is not None:
            # One of aiosqlite's own calls (execute, executemany,
            # execute_insert, ...; the cursor and the ends take the BEGIN
            # before they get here): the held BEGIN goes first, in its trip,
            # so the call runs inside the transaction, as it did when the
            # BEGIN was sent at once. Left held, the call ran outside it
            # (autocommit), and a rollback finding only the BEGIN sent nothing.
            fn = partial(self._begun, begin, partial(fn, *args, **kwargs))
            args, kwargs = (), {}
        return await super()._execute(fn, *args, **kwargs)

    def _begun(self, begin: str, call: Any) -> Any:
        """On the thread: the held-back BEGIN, then the call."""
        self._open(begin)
        return call()

    def _open(self, begin: str) -> None:
        """On the thread: a held-back BEGIN, sent at last (where a writer
        waits for SQLite's write lock)."""
        self._conn.execute(begin)

    def _steps(
        self, steps: list[tuple[str, str, Any]], commit: bool = False
    ) -> tuple[list[tuple[Any, list[Any], int]], bool]:
        """On the thread: each statement in its order, with every row of
        each, then (with ``commit``) the commit; each one's (description,
        rows, row count), and whether a transaction is open after them. A
        statement that fails stops the rest, the commit too; its error
        carries its index as ``step`` (the commit's: ``len(steps)``)."""
        done = []
        for index, (method, sql, parameters) in enumerate(steps):
            cursor = self._conn.cursor()
            try:
                getattr(cursor, method)(sql, parameters)
                rows = cursor.fetchall() if cursor.description else []
                done.append((cursor.description, rows, cursor.rowcount))
            except sqlite3.Error as error:
                error.step = index  # type: ignore[attr-defined]
                raise
            finally:
                cursor.close()
        if commit:
            try:
                self._conn.commit()
            except sqlite3.Error as error:
                error.step = len(steps)  # type: ignore[attr-defined]
                raise
        return done, self._conn.in_transaction

    async def run_steps(
        self, steps: list[tuple[str, str, Any]], commit: bool = False
    ) -> list[tuple[Any, list[Any], int]]:
        """Several statements in one trip (a held BEGIN first, as with any
        call), with ``commit`` the transaction's commit after them; see
        :meth:`_steps`. Statements sent outside a transaction (a lone read,
        in SQLite's autocommit), or committed, leave the connection known
        idle outside one, by the rule of :meth:`_end`, so the pool's
        rollback after them is not sent."""
        queued = self._queued
        done, still_open = await self._execute(self._steps, steps, commit)
        self._idle_outside_transaction = not still_open and self._queued == queued + 1
        return done

    def _hold_begin(self, sql: str) -> bool:
        """Hold a BEGIN back for the next statement, if nothing can differ."""
        if not self._idle_outside_transaction or sql.strip().upper() not in _BEGINS:
            return False
        self._begin = sql
        self._idle_outside_transaction = False
        return True

    def _take_begin(self) -> str | None:
        begin, self._begin = self._begin, None
        return begin

    def _ended(self, end: str) -> bool:
        """On the thread: commit or roll back; whether a transaction is
        still open (it is, if the commit failed)."""
        getattr(self._conn, end)()
        return self._conn.in_transaction

    async def _end(self, end: str) -> None:
        if self._take_begin() is not None:
            # BEGIN and nothing else: nothing was sent, nothing to end.
            self._idle_outside_transaction = True
            return
        queued = self._queued
        still_open = await self._execute(self._ended, end)
        # Known only if nothing was queued after this end (another task on
        # this connection, say, whose BEGIN ran behind it): that call's
        # effect on the transaction is not known here.
        self._idle_outside_transaction = not still_open and self._queued == queued + 1

    async def commit(self) -> None:
        await self._end("commit")

    async def rollback(self) -> None:
        if self._idle_outside_transaction:
            return  # nothing to roll back, and the thread is idle
        await self._end("rollback")

    async def close(self) -> None:
        self._begin = None
        self._idle_outside_transaction = False
        await super().close()


def connect(database: str, **kwargs: Any) -> OneTripConnection:
    """As ``aiosqlite.connect``, for SQLAlchemy's ``async_creator_fn``: it
    receives the arguments the dialect would have given aiosqlite."""
    connection = OneTripConnection(partial(sqlite3.connect, database, **kwargs), _ITER_CHUNK_SIZE)
    # As SQLAlchemy does for aiosqlite's own: the thread must not keep a
    # process alive that forgot to dispose of its engine.
    connection._thread.daemon = True
    return connection
