"""Core statements on PostgreSQL without SQLAlchemy's execution around each
(core_statements.py says what is kept of SQLAlchemy's and what is not).

Each statement goes to the asyncpg connection that SQLAlchemy's adapter
holds, prepared in the adapter's own statement cache, inside the adapter's
own transaction, under its lock. SQLAlchemy still owns the connection's
life, so nothing about a transaction's ends changes: the connection is
checked out (and pinged) by the pool, its isolation level and read-only flag
are the adapter's, SQLAlchemy's ``begin`` opens the transaction and its
commit and rollback end it (their listeners told as before), and the pool
rolls back whatever is still open when the connection goes back. A
transaction this module began and could not end is never handed to the next
borrower.

Errors go to SQLAlchemy's own handler, in its greenlet: raised as the same
``sqlalchemy.exc`` class, parameters hidden as the engine hides them, and a
connection lost or left in the middle of a statement (a disconnect, a
cancellation) is invalidated as SQLAlchemy invalidates it, so the pool never
lends it again, and the server is sent the cancel of a statement cut off, so
its backend does not run on holding its locks. A connection refuses
statements once its block has ended, as SQLAlchemy's closed one does.

This relies on private parts of SQLAlchemy (the adapter's lock, transaction
start and statement cache in ``sqlalchemy/dialects/postgresql/asyncpg.py``,
and ``Connection._handle_dbapi_exception``), which is why pyproject pins
SQLAlchemy's minor version; ``tests/test_pg_core.py`` holds this module to
SQLAlchemy's answers, errors and invalidation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator
from typing import Any, NoReturn

from sqlalchemy import exc
from sqlalchemy.dialects.postgresql.asyncpg import AsyncAdapt_asyncpg_connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.util import greenlet_spawn

from roundtable.completion import to_completion
from roundtable.store import engine as engines
from roundtable.store.core_statements import (
    CoreConnection,
    CoreResult,
    CoreStatements,
    CursorFacts,
)

logger = logging.getLogger(__name__)

# The rows a command touched, from asyncpg's status message, as SQLAlchemy's
# adapter reads it.
_COUNTED = re.compile(r"(?:SELECT|UPDATE|DELETE|INSERT \d+) (\d+)")


class PostgresCoreConnection(CoreStatements):
    """A connection on PostgreSQL, for Core statements: what the store's hot
    paths call of SQLAlchemy's AsyncConnection (``execute`` and
    ``dialect``), each statement one trip, without SQLAlchemy's execution
    context around it."""

    def __init__(self, pooled: AsyncConnection, adapted: AsyncAdapt_asyncpg_connection) -> None:
        self._sync_connection = pooled.sync_connection
        self._engine = self._sync_connection.engine
        self.dialect = pooled.dialect
        self._adapted = adapted

    async def execute(self, statement: Any, parameters: Any = None) -> CoreResult:
        self._refuse_unless_open()
        (sql, bound, many), compiled = self._step(statement, parameters)
        try:
            description, rows, rowcount = await self._send(sql, bound, many)
        except BaseException as error:
            await self._failed(error, sql, bound)
        facts = CursorFacts(description, rowcount)
        self._engine.dispatch.after_cursor_execute(
            self._sync_connection, facts, sql, bound, None, many
        )
        return self._result(compiled, statement, description, rows, rowcount)

    async def _send(self, sql: str, bound: Any, many: bool) -> tuple[Any, list[Any], int]:
        """One statement, as SQLAlchemy's adapter's cursor sends it: under
        the adapter's lock, in its transaction (begun here if this is the
        first statement), prepared from its cache."""
        adapted = self._adapted
        schema_as_of = self.dialect._invalidate_schema_cache_asof
        async with adapted._execute_mutex:
            if adapted._transaction is None:
                await adapted._start_transaction()
            if many:
                await adapted._check_type_cache_invalidation(schema_as_of)
                await adapted._connection.executemany(sql, bound)
                return None, [], -1
            prepared, attributes = await adapted._prepare(sql, schema_as_of)
            rows = await prepared.fetch(*bound)
            status = prepared.get_statusmsg()
        description = (
            [(a.name, a.type.oid, None, None, None, None, None) for a in attributes]
            if attributes
            else None
        )
        counted = _COUNTED.match(status or "")
        return description, rows, int(counted.group(1)) if counted else -1

    def _refuse_unless_open(self) -> None:
        """Statements only inside the transaction this connection was handed
        out for, as SQLAlchemy's own connection refuses them: a handle kept
        past its block would otherwise begin a transaction on a connection
        the pool has taken back (and lend it, or send into another
        borrower's transaction); one invalidated needs its rollback first."""
        connection = self._sync_connection
        if connection.invalidated:
            raise exc.PendingRollbackError(
                "this connection was invalidated (lost, or cut off in the middle of a "
                "statement); its transaction must be rolled back before anything else"
            )
        if not connection.in_transaction():
            raise exc.ResourceClosedError("this connection's transaction has ended")

    async def _failed(self, error: BaseException, sql: str, bound: Any) -> NoReturn:
        """Raise ``error`` as SQLAlchemy would have: asyncpg's own error as
        the DB-API's (the adapter's translation), then wrapped, the
        connection invalidated when it is lost or was left mid-statement.
        The handler runs in SQLAlchemy's greenlet, as on its own path: there
        an invalidated connection is closed gracefully, which lets asyncpg
        send the server its cancel request for a statement cut off by a
        cancellation (outside it, the connection is dropped at once and the
        server's backend runs on, holding its locks, until the statement
        ends)."""
        dbapi = self.dialect.loaded_dbapi
        if isinstance(error, Exception) and not isinstance(error, dbapi.Error):
            try:
                self._adapted._handle_exception(error)  # always raises
            except Exception as translated:  # the error itself, if not asyncpg's
                error = translated
        if isinstance(error, dbapi.InvalidCachedStatementError | dbapi.InternalServerError):
            # As the dialect's execution context does: the prepared
            # statements' column types may be stale after DDL.
            self.dialect._invalidate_schema_cache()
        handle = self._sync_connection._handle_dbapi_exception
        failed = error

        def handled() -> None:
            try:
                raise failed  # the handler reads the error being handled
            except BaseException:
                handle(failed, sql, bound, None, None)

        if isinstance(error, asyncio.CancelledError):
            # A statement cut off by a cancellation: the handling runs to its
            # end even if this task is cancelled again meanwhile (a graceful
            # close cut short drops the connection at once, and with it the
            # cancel request asyncpg has not sent yet).
            await to_completion(greenlet_spawn)(handled)
        else:
            # In this task: a KeyboardInterrupt raised in a task of its own
            # would stop the event loop.
            await greenlet_spawn(handled)
        raise error  # unreachable: the handler always raises


def over(pooled: AsyncConnection) -> CoreConnection:
    """This module's connection over a checked-out one; the connection itself
    on a driver other than asyncpg. Its SQLAlchemy transaction must be begun:
    an error's handling assumes one (outside one it would roll back, which
    needs SQLAlchemy's greenlet)."""
    adapted = pooled.sync_connection.connection.dbapi_connection
    if not isinstance(adapted, AsyncAdapt_asyncpg_connection):
        return pooled
    return PostgresCoreConnection(pooled, adapted)


@contextlib.asynccontextmanager
async def reading(engine: AsyncEngine) -> AsyncIterator[CoreConnection]:
    """A pooled connection for reads, in a transaction rolled back at the end
    (at the engine's isolation level: READ COMMITTED unless configured)."""
    async with begun(engine) as pooled:
        await pooled.begin()
        yield over(pooled)


@contextlib.asynccontextmanager
async def begun(
    engine: AsyncEngine, isolation_level: str | None = None
) -> AsyncIterator[AsyncConnection]:
    """A pooled connection whose server transaction is begun before it is
    handed over, by a BEGIN that is also the checkout's ping: one round
    trip where the pool's ping and the first statement's BEGIN were two.
    The caller begins SQLAlchemy's transaction on it as on any connection
    (no trip on asyncpg; the first statement finds the transaction open).

    The BEGIN does all a ping does. A connection it finds lost, one that
    does not answer within the ping's time, or one the server still has
    inside a transaction (a borrower's, begun behind the adapter's back,
    whose reply may still have been on its way when the pool checked:
    ``_FRESH`` fails there) is closed, so the server rolls back whatever
    it held, and the borrower is lent a connection checked out the usual
    way, pinged by the pool. ``isolation_level`` is set before the BEGIN
    (setting it after would roll the BEGIN back and begin again, a trip
    more); so are read-only and deferrable set on the connection after
    (engine._flag_setter). On a driver other than asyncpg, the pool pings
    and the transaction begins as ever.

    The transaction begins at checkout, not at the first statement: at
    REPEATABLE READ or SERIALIZABLE its snapshot is taken then (a
    Database.snapshot() sees the instant its block was entered), and the
    server's ``idle_in_transaction_session_timeout`` counts from then. The
    store's callers send their first statement at once."""
    async with contextlib.AsyncExitStack() as stack:
        held = engines.PING_LEFT_TO_BEGIN.set(True)
        try:
            pooled = await stack.enter_async_context(engine.connect())
        finally:
            engines.PING_LEFT_TO_BEGIN.reset(held)
        if isolation_level is not None:
            await pooled.execution_options(isolation_level=isolation_level)
        if await _begin_as_ping(pooled):
            yield pooled
            return
    async with engine.connect() as pooled:  # pinged by the pool
        if isolation_level is not None:
            await pooled.execution_options(isolation_level=isolation_level)
        yield pooled


# After the BEGIN, in the same message: a transaction begun by this BEGIN
# started when the message came (PostgreSQL sets the transaction's start
# to its first statement's), one begun before it did not, and then this
# divides by zero. Only an error makes a simple query's answer visible.
# Every name is pg_catalog's: through the search_path, a schema listed
# before it could shadow a function or operator and pass the check always.
_FRESH = (
    "SELECT 1 OPERATOR(pg_catalog./) (pg_catalog.transaction_timestamp()"
    " OPERATOR(pg_catalog.=) pg_catalog.statement_timestamp())::pg_catalog.int4"
)
_LEVELS = {
    "read_committed": " ISOLATION LEVEL READ COMMITTED",
    "repeatable_read": " ISOLATION LEVEL REPEATABLE READ",
    "serializable": " ISOLATION LEVEL SERIALIZABLE",
}


class _BegunWithPing:
    """The transaction :func:`begun` opened, where the adapter keeps
    asyncpg's own (``_transaction``): the adapter ends it through these."""

    __slots__ = ("_driver",)
    # engine._flag_setter rolls it back for a read-only or deferrable flag
    # set after the BEGIN went without it.
    begun_with_ping = True

    def __init__(self, driver: Any) -> None:
        self._driver = driver

    async def commit(self) -> None:
        await self._driver.execute("COMMIT;")

    async def rollback(self) -> None:
        await self._driver.execute("ROLLBACK;")


async def _begin_as_ping(pooled: AsyncConnection) -> bool:
    """Begin the connection's transaction, as the adapter would (its
    isolation level, read-only and deferrable flags), in the same trip as
    the check that it is the connection's own; False, the connection
    closed and invalidated, when it is not to be lent (and under
    AUTOCOMMIT, where no BEGIN carries the ping: the pool pings the next).
    True, with nothing sent, on a driver other than asyncpg, which the
    pool pinged as ever."""
    adapted = pooled.sync_connection.connection.dbapi_connection
    if not isinstance(adapted, AsyncAdapt_asyncpg_connection):
        return True
    if adapted.autocommit:
        return False
    # The pool's reset ended the last borrower's (as asyncpg's own start
    # asserts, a transaction is begun only where none is kept).
    assert adapted._transaction is None, "a pooled connection lent with its transaction"
    driver = adapted._connection
    sql = "BEGIN" + _LEVELS.get(adapted.isolation_level or "", "")
    sql += " READ ONLY" if adapted.readonly else ""
    sql += " DEFERRABLE" if adapted.deferrable else ""
    try:
        await driver.execute(f"{sql}; {_FRESH}", timeout=engines.ping_timeout(driver))
    except TimeoutError:
        why = "did not answer its ping (its BEGIN)"
    except Exception as error:  # lost, or inside a transaction: never lent
        # The BEGIN binds no values: its error's text quotes nothing stored.
        why = f"was found inside a transaction, or failed, at its BEGIN ({error!r})"
    except BaseException:  # cut off mid-BEGIN: what the server did is unknown
        await _discard(pooled, driver, "was cut off at its BEGIN")
        raise
    else:
        adapted._transaction = _BegunWithPing(driver)
        return True
    await _discard(pooled, driver, why)
    return False


async def _discard(pooled: AsyncConnection, driver: Any, why: str) -> None:
    """Close the connection (the server rolls back what it holds) and
    invalidate it, so the pool never lends it again."""
    if not driver.is_closed():
        engines.close_unlendable(driver, why)
    else:
        logger.info("a pooled PostgreSQL connection was lost; replaced (%s)", why)
    await to_completion(pooled.invalidate)()
