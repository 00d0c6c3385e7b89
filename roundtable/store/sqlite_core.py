"""Core statements on SQLite without SQLAlchemy's execution around each
(core_statements.py says what is kept of SQLAlchemy's and what is not): each
statement runs through the connection's one-trip cursor (sqlite_driver.py),
and writes whose answer nobody reads wait to go in the next statement's trip.

As SQLAlchemy does it, here too: ``commit`` and ``rollback`` listeners are
told in SQLAlchemy's order, and a database error, or a value a type refuses,
is raised as the same ``sqlalchemy.exc`` class, its parameters hidden as the
engine hides them. What differs: the cursor lives on SQLite's thread (an
after-listener gets its description and row count); the engine's ``begin``
event is not fired (its one listener, engine.py's, is what sends BEGIN on
SQLAlchemy's path; here the BEGIN is sent, and told, as a statement).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy import exc
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.pool import QueuePool

from roundtable.completion import to_completion
from roundtable.store.core_statements import (
    CoreConnection,
    CoreResult,
    CoreStatements,
    CursorFacts,
)
from roundtable.store.sqlite_driver import OneTripConnection
from roundtable.store.sqlite_readers import HeldReaders


class SQLiteCoreConnection(CoreStatements):
    """A transaction's connection on SQLite, for Core statements: what the
    store's hot paths call of SQLAlchemy's AsyncConnection (``execute`` and
    ``dialect``), each statement one trip to SQLite's thread."""

    def __init__(
        self,
        engine: AsyncEngine,
        driver: OneTripConnection,
        sync_connection: Any,
        *,
        read_only: bool = False,
        alone: bool = False,
    ) -> None:
        self._engine = engine.sync_engine
        self.dialect: Dialect = engine.dialect
        self._driver = driver
        # Told to the listeners as their connection argument, as SQLAlchemy does.
        self._sync_connection = sync_connection
        # Writes prepared by later(), not sent yet.
        self._later: list[tuple[str, Any, bool]] = []
        self._read_only = read_only
        # SQLite refuses a reader's writes itself (engine.refuse_writes).
        driver.reading = read_only
        # One statement only, outside any transaction (reading(alone=True)).
        self._alone = alone
        self._sent = 0
        # Committed by execute_and_commit: nothing more is sent.
        self._committed = False
        # Set once its block has ended: a handle kept past it is refused
        # (its statements would run on a connection the pool has taken back,
        # outside any transaction or inside another borrower's).
        self.ended = False

    async def execute(self, statement: Any, parameters: Any = None) -> CoreResult:
        self._refuse_if_ended()
        self._refuse_if_committed()
        if self._alone and self._sent:
            raise RuntimeError("a lone read runs one statement; use a reading transaction")
        self._sent += 1
        step, compiled = self._step(statement, parameters)
        # Writes left for later go first, in this statement's trip.
        steps, self._later = [*self._later, step], []
        description, rows, rowcount = (await self._send(steps))[-1]
        return self._result(compiled, statement, description, rows, rowcount)

    async def execute_and_commit(self, statement: Any, parameters: Any = None) -> CoreResult:
        """The transaction's last statement and its commit, in one trip, with
        the writes left for later before it: the statement's result. The
        commit's listeners are told first, as :meth:`commit` tells them (one
        that raises stops it); the block's own commit then sends nothing,
        and a statement after this one is refused. If the statement or the
        commit fails, nothing is committed and the block rolls back. Unlike
        SQLAlchemy's, the after-listeners hear of the statement once it is
        committed, so one that raises cannot undo it; and an await cancelled
        while the trip runs cannot tell whether the commit was made (the
        thread finishes it). So this is for a write that is safe to find
        made when its caller was told of an error, as the turn journal's
        insert is (its retry reads the answer kept), and for the store's
        calls only, which run to their own end (roundtable/completion.py).
        The transaction's other commits keep their own trip for that reason
        (a listener raising after a write left for later, or a cut before
        the commit, leaves nothing: tests/test_review_core_writes.py)."""
        self._refuse_if_ended()
        self._refuse_if_committed()
        if self._read_only:
            raise RuntimeError("a reading connection does not write; use a transaction")
        self._sent += 1
        step, compiled = self._step(statement, parameters)
        steps, self._later = [*self._later, step], []
        self._engine.dispatch.commit(self._sync_connection)
        description, rows, rowcount = (await self._send(steps, commit=True))[-1]
        return self._result(compiled, statement, description, rows, rowcount)

    def _refuse_if_committed(self) -> None:
        if self._committed:
            raise RuntimeError("this transaction has committed; nothing more goes in it")

    def later(self, statement: Any, parameters: Any = None) -> None:
        """A write whose answer the transaction does not need (an INSERT, an
        UPDATE whose row count nobody checks): prepared and told to the
        listeners now (so unstorable text is refused here, as ``execute``
        refuses it), sent with the transaction's next statement, in its
        trip, or in one trip just before the commit. Its error, if any, is
        raised there. A reader's connection refuses it: nothing would send
        it."""
        self._refuse_if_ended()
        self._refuse_if_committed()
        if self._read_only:
            raise RuntimeError("a reading connection does not write; use a transaction")
        self._later.append(self._step(statement, parameters)[0])

    async def _send(
        self, steps: list[tuple[str, Any, bool]], commit: bool = False
    ) -> list[tuple[Any, list[Any], int]]:
        """The statements in one trip to SQLite's thread (with ``commit``,
        the commit after them), told to the after-listeners (with what the
        cursor gave: description and row count); an error raised as
        SQLAlchemy raises it, for the statement that failed."""
        error_class = self.dialect.loaded_dbapi.Error
        sent = [("executemany" if many else "execute", sql, bound) for sql, bound, many in steps]
        try:
            done = await self._driver.run_steps(sent, commit)
        except error_class as error:
            failed = getattr(error, "step", -1)
            sql, bound, many = ("COMMIT", (), False) if failed == len(steps) else steps[failed]
            raise exc.DBAPIError.instance(
                sql,
                bound,
                error,
                error_class,
                hide_parameters=True,
                dialect=self.dialect,
                ismulti=many,
            ) from error
        if commit:
            # Known before any after-listener runs: one that raises then
            # leaves the block's rollback nothing to undo or tell.
            self._committed = True
        dispatch = self._engine.dispatch
        for (sql, bound, many), (description, _, rowcount) in zip(steps, done, strict=True):
            cursor = CursorFacts(description, rowcount)
            dispatch.after_cursor_execute(self._sync_connection, cursor, sql, bound, None, many)
        return done

    async def begin(self, sql: str) -> None:
        """Open the transaction: ``sql`` goes with the first statement (the
        one-trip cursor holds it back while the connection is known idle)."""
        dispatch = self._engine.dispatch
        dispatch.before_cursor_execute(self._sync_connection, None, sql, (), None, False)
        await self._driver.cursor().execute(sql)
        facts = CursorFacts(None, -1)
        dispatch.after_cursor_execute(self._sync_connection, facts, sql, (), None, False)

    def _refuse_if_ended(self) -> None:
        if self.ended:
            raise exc.ResourceClosedError("this connection's transaction has ended")

    async def commit(self) -> None:
        if self._committed:  # by execute_and_commit
            return
        # Writes left for later go in one trip before the commit's: the
        # listeners hear of them before the transaction commits, and a
        # transaction cancelled while they run rolls back, as before.
        steps, self._later = self._later, []
        if steps:
            await self._send(steps)
        # Told before the commit, as SQLAlchemy tells it: a listener that
        # raises stops the commit (the caller then rolls back).
        self._engine.dispatch.commit(self._sync_connection)
        try:
            await self._driver.commit()
        except self.dialect.loaded_dbapi.Error as error:
            raise exc.DBAPIError.instance(
                "COMMIT", (), error, self.dialect.loaded_dbapi.Error, dialect=self.dialect
            ) from error

    async def rollback(self) -> None:
        if self._committed:  # an error after execute_and_commit: nothing to undo
            return
        self._later = []  # never sent
        self._engine.dispatch.rollback(self._sync_connection)
        await self._driver.rollback()


async def _own(
    engine: AsyncEngine, pooled: AsyncConnection, **options: bool
) -> SQLiteCoreConnection | None:
    """This module's connection over the pooled one; None on an engine
    built on aiosqlite's own driver, which keeps SQLAlchemy's."""
    driver = (await pooled.get_raw_connection()).driver_connection
    if not isinstance(driver, OneTripConnection):
        return None
    return SQLiteCoreConnection(engine, driver, pooled.sync_connection, **options)


async def close_stale(pooled: AsyncConnection, driver: OneTripConnection) -> None:
    """Close a connection from a pool the engine has since replaced (disposed
    of), which that pool would never close: SQLite's connection and its
    thread first, by the driver itself, then SQLAlchemy's record invalidated,
    which finds nothing left to close. SQLAlchemy's own termination, cut by
    an event loop's teardown (which cancels every task), left a close
    waiting for a thread already stopped, and the process never exited
    (a review of the readers' kept connections found it; the writers' held
    connection did the same)."""
    await driver.close()
    await pooled.invalidate()


async def let_go(
    engine: AsyncEngine, pooled: AsyncConnection, driver: OneTripConnection, source: Any
) -> None:
    """A connection taken from the pool ``source`` given back to it (whose
    reset rolls back what is open), or closed if the engine has since
    replaced that pool, which would never close it (:func:`close_stale`)."""
    if pooled.closed:
        return
    if source is not engine.sync_engine.pool:
        await close_stale(pooled, driver)
    else:
        await pooled.close()


class HeldConnection:
    """One pooled connection kept out of the pool between transactions that
    run one at a time (the store's writers, queued by its writer lock: the
    holder must never lend it to two blocks at once). Taking a connection
    out of SQLAlchemy's pool and putting it back (its greenlet hops, the
    pool's bookkeeping, the shielded close's turns of the event loop) was a
    sixth of a claim's time on SQLite. Lent again only if its last block
    left it known idle outside a transaction (the driver's own rule, which
    also lets a BEGIN wait for the next statement); anything else (a
    rollback that failed, a block cancelled while a call ran on SQLite's
    thread) sends it back to the pool, whose reset rolls it back, and the
    next block takes a fresh one. :meth:`close` when done: a held
    connection is not the pool's to close. Taking and giving back run to
    their end whatever cancels their caller, as leaving ``engine.connect()``
    does: a close cut half-way once left a task no shutdown could end."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        # The pooled connection, its driver, and the pool it came from, while
        # held.
        self._held: tuple[AsyncConnection, OneTripConnection, Any] | None = None
        # Nothing is held on an engine on aiosqlite's own driver, nor from a
        # pool that could lend nobody else a connection meanwhile (a queue
        # of one), nor one that shares or never keeps its connections.
        pool = engine.sync_engine.pool
        self._unsupported = not isinstance(pool, QueuePool) or pool.size() < 2
        # Set by close: nothing is held from then on.
        self.closed = False
        # A block is using the held connection (it gives it back at its end
        # if closed meanwhile).
        self.lent = False

    async def take(self) -> tuple[AsyncConnection, OneTripConnection] | None:
        """The held connection, taken from the pool first if none is held
        (or the pool it came from was disposed of); None where nothing is
        held."""
        if self._unsupported or self.closed:
            return None
        held = self._held
        if held is not None and held[2] is self._engine.sync_engine.pool:
            if not (held[0].closed or held[0].invalidated):
                return held[0], held[1]
        return await self._take_afresh()

    @to_completion
    async def _take_afresh(self) -> tuple[AsyncConnection, OneTripConnection] | None:
        if self._held is not None:
            pooled, driver, pool = self._held
            self._held = None
            if pool is not self._engine.sync_engine.pool and not pooled.closed:
                # The engine was disposed of and has a new pool: the old one
                # would keep this connection, and nothing would close it.
                await close_stale(pooled, driver)
        pool = self._engine.sync_engine.pool
        pooled = await self._engine.connect()
        driver = (await pooled.get_raw_connection()).driver_connection
        if not isinstance(driver, OneTripConnection):
            await pooled.close()
            self._unsupported = True
            return None
        self._held = pooled, driver, pool
        return pooled, driver

    @property
    def driver(self) -> OneTripConnection | None:
        """The held connection's driver, while one is held."""
        return None if self._held is None else self._held[1]

    @to_completion
    async def release(self) -> None:
        """Back to the pool (which rolls back whatever it finds open); one
        from a pool the engine has since replaced is closed instead, which
        that pool would never do (review: a writer in use across
        open_store's exit left its connection's thread running)."""
        held, self._held = self._held, None
        if held is not None:
            await let_go(self._engine, *held)

    async def close(self) -> None:
        """Hold nothing from now on: given back now, or by the block using
        it at that block's end (not waited for: a shutdown must not wait on
        every writer queued)."""
        self.closed = True
        if not self.lent:
            await self.release()


@contextlib.asynccontextmanager
async def transaction(
    engine: AsyncEngine, begin: str, held: HeldConnection | None = None
) -> AsyncIterator[CoreConnection]:
    """A pooled connection (``held``'s, if given), in one transaction opened
    by ``begin`` (``BEGIN IMMEDIATE`` for a writer, ``BEGIN`` for a
    reader): committed when the block ends, rolled back when it raises (or
    is cancelled). An engine built on aiosqlite's own driver (tests compare
    against it) gets SQLAlchemy's connection, as before."""
    taken = await held.take() if held is not None else None
    if taken is not None and held is not None:
        pooled, driver = taken
        connection = SQLiteCoreConnection(engine, driver, pooled.sync_connection)
        held.lent = True
        try:
            async with _block(connection, begin) as block:
                yield block
        finally:
            held.lent = False
            if held.closed or not driver.known_idle:
                await held.release()
        return
    async with engine.connect() as pooled:
        connection = await _own(engine, pooled)
        if connection is None:
            async with pooled.begin():
                yield pooled
            return
        async with _block(connection, begin) as block:
            yield block


@contextlib.asynccontextmanager
async def _block(connection: SQLiteCoreConnection, begin: str) -> AsyncIterator[CoreConnection]:
    await connection.begin(begin)
    try:
        yield connection
        await connection.commit()
    except BaseException:
        await connection.rollback()
        raise
    finally:
        connection.ended = True


@contextlib.asynccontextmanager
async def reading(
    engine: AsyncEngine, alone: bool = False, held: HeldReaders | None = None
) -> AsyncIterator[CoreConnection]:
    """A pooled connection (one of ``held``'s, if it keeps any) in a
    deferred transaction, rolled back at the end: its reads see one instant
    and take no write lock. ``alone``: for one statement only, sent with no
    transaction around it (SQLite's autocommit gives a lone statement its
    own), one trip in all; a second is refused. (aiosqlite's own driver: as
    :func:`transaction`.)"""
    lent = await held.take() if held is not None else None
    if lent is not None and held is not None:
        pooled, driver, _pool = lent
        connection = SQLiteCoreConnection(
            engine, driver, pooled.sync_connection, read_only=True, alone=alone
        )
        try:
            async with _read(connection, alone) as block:
                yield block
        finally:
            await held.give_back(lent)
        return
    async with engine.connect() as pooled:
        connection = await _own(engine, pooled, read_only=True, alone=alone)
        if connection is None:
            yield pooled
            return
        async with _read(connection, alone) as block:
            yield block


@contextlib.asynccontextmanager
async def _read(connection: SQLiteCoreConnection, alone: bool) -> AsyncIterator[CoreConnection]:
    try:
        if alone:
            yield connection
            return
        await connection.begin("BEGIN")
        try:
            yield connection
        finally:
            await connection.rollback()
    finally:
        connection.ended = True
