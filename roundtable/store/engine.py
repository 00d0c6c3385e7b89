"""Engine construction and the few places where SQLite and PostgreSQL differ.

Kept in one module so the store's operations read the same on both databases.
"""

from __future__ import annotations

import logging
import os
from contextvars import ContextVar
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from asyncpg.exceptions import InterfaceError
from sqlalchemy import event, func, literal, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.exc import InvalidRequestError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.util.concurrency import await_

from roundtable.config import PoolSizing
from roundtable.store import sqlite_driver
from roundtable.store.core_statements import CoreConnection
from roundtable.store.errors import InvalidInputError
from roundtable.store.text import check_parameters, dumps_storable

SUPPORTED_DRIVERS = ("sqlite+aiosqlite", "postgresql+asyncpg")
# Seconds a SQLite writer waits for the lock. Long on purpose: under 50
# concurrent claimers a short timeout turns contention into errors.
SQLITE_BUSY_TIMEOUT_MS = 60_000
READ_ONLY_OPTION = "roundtable_read_only"
logger = logging.getLogger(__name__)
# How long the pool waits for a pooled PostgreSQL connection to answer its
# ping before it takes the connection for lost. Generous: a server that
# needs longer to answer SELECT 1 is in trouble anyway.
PING_TIMEOUT_SECONDS = 10.0
# Set while a checkout's ping is left to the BEGIN its borrower sends at
# once (pg_core.begun): that BEGIN is the trip that finds a lost connection,
# one round trip fewer a transaction. The checks that need no trip stay.
PING_LEFT_TO_BEGIN: ContextVar[bool] = ContextVar("roundtable_ping_left_to_begin", default=False)


def create_engine_for(database_url: str, pool: PoolSizing | None = None) -> AsyncEngine:
    """The store's engine for ``database_url``; ``pool`` sizes PostgreSQL's
    connection pool (SQLite's is the store's own, whatever it says)."""
    url = make_url(database_url)
    if url.drivername not in SUPPORTED_DRIVERS:
        raise InvalidInputError(
            f"unsupported database URL driver {url.drivername!r}; "
            f"use one of {', '.join(SUPPORTED_DRIVERS)}"
        )
    if url.drivername.startswith("sqlite"):
        return _refusing_unstorable(_sqlite_engine(database_url))
    # hide_parameters: a database error's message (which reaches logs and
    # Temporal failures) never quotes the values it was bound to.
    engine = create_async_engine(
        database_url,
        pool_pre_ping=True,
        hide_parameters=True,
        json_serializer=dumps_storable,
        **(pool or PoolSizing()).engine_options(),
    )
    dialect = engine.sync_engine.dialect
    dialect.do_ping = _one_trip_ping  # type: ignore[method-assign]
    dialect.set_readonly = _flag_setter("readonly")  # type: ignore[method-assign]
    dialect.set_deferrable = _flag_setter("deferrable")  # type: ignore[method-assign]
    return _refusing_unstorable(engine)


def _flag_setter(flag: str) -> Any:
    """The dialect's set_readonly or set_deferrable, for connections whose
    BEGIN went at checkout (pg_core.begun) without the flag: SQLAlchemy
    sets these only before its own transaction begins, so nothing has run
    in the server's yet; it is rolled back, as the adapter's own
    set_isolation_level does, and the next statement begins anew with the
    flag. Otherwise a read-only transaction asked for there would quietly
    take writes."""

    def set_flag(dbapi_connection: Any, value: bool) -> None:
        begun = getattr(dbapi_connection._transaction, "begun_with_ping", False)
        if begun and getattr(dbapi_connection, flag) != value:
            dbapi_connection.rollback()
        setattr(dbapi_connection, flag, value)

    return set_flag


def _one_trip_ping(dbapi_connection: Any) -> bool:
    """The pool's pre-ping on PostgreSQL in one round trip: ``SELECT 1`` as a
    simple query. SQLAlchemy's own asyncpg ping is three (BEGIN, an empty
    prepared statement, ROLLBACK): it opens a transaction so that, behind
    pgbouncer in transaction mode, the statement it prepares is run on the
    server connection it was prepared on. A simple query prepares nothing,
    runs as a transaction of its own and is one message each way, so it is
    safe there too. Errors go through the adapter's own translation, so
    SQLAlchemy's pre-ping sees the same DBAPI errors and tells a lost
    connection (reconnect) from any other error (raised) as it does for its
    own ping.

    A connection the server still has inside a transaction (a borrower
    began one behind the adapter's back, which the pool's reset cannot see)
    is never lent: whatever it holds would be committed, or fail, with the
    next borrower's work. SQLAlchemy's ping happened to refuse it (its BEGIN
    fails there); this one closes it, so the server rolls that transaction
    back, and the pool replaces it as a lost connection. So is one that
    does not answer within ``PING_TIMEOUT_SECONDS``, where SQLAlchemy's
    ping waited for ever.

    Under ``PING_LEFT_TO_BEGIN`` only the checks that need no trip are
    made here (closed, or inside a transaction by the last reply); the
    borrower's BEGIN, sent at once, makes the rest (pg_core.begun)."""
    driver = dbapi_connection.driver_connection
    try:
        # First from the server's last reply (no trip; a failed transaction
        # would fail SELECT 1 itself), then from its reply to SELECT 1: the
        # last reply may be older than one still on its way (a borrower's
        # statement cancelled mid-flight), SELECT 1's answer is not.
        inside = not driver.is_closed() and driver.is_in_transaction()
        if not inside and PING_LEFT_TO_BEGIN.get() and not driver.is_closed():
            return True  # the borrower's BEGIN goes now, and checks the rest
        if not inside:
            await_(driver.execute("SELECT 1", timeout=ping_timeout(driver)))
            inside = driver.is_in_transaction()
        if inside:
            close_unlendable(driver, "was found inside a transaction")
            raise InterfaceError("a pooled connection was inside a transaction")
    except TimeoutError:
        # No answer: a frozen backend, or a connection cut without a word (a
        # failover, a firewall's idle drop), where the socket would wait out
        # TCP's retries, a quarter of an hour. Replaced, as a lost one.
        close_unlendable(driver, "did not answer its ping")
        dbapi_connection._handle_exception(InterfaceError("no answer to the pool's ping"))
    except Exception as error:
        dbapi_connection._handle_exception(error)
    return True


def close_unlendable(driver: Any, why: str) -> None:
    """Close a pooled connection the ping will not lend: the server rolls
    back whatever it had open, and the failed ping makes the pool replace it."""
    logger.warning("a pooled PostgreSQL connection %s; closed and replaced", why)
    driver.terminate()


def ping_timeout(driver: Any) -> float:
    """``PING_TIMEOUT_SECONDS``, or the connection's own command timeout
    (``?command_timeout=`` in the URL) where that is shorter."""
    own = driver._config.command_timeout
    return min(PING_TIMEOUT_SECONDS, own) if own else PING_TIMEOUT_SECONDS


def _refusing_unstorable(engine: AsyncEngine) -> AsyncEngine:
    """Text the database cannot store fails as bad input before it is sent,
    alike on both databases (see store/text.py)."""

    @event.listens_for(engine.sync_engine, "before_cursor_execute")
    def _check(
        _conn: Any, _cursor: Any, _sql: str, parameters: Any, _context: Any, _many: bool
    ) -> None:
        check_parameters(parameters)

    return engine


def _sqlite_engine(database_url: str) -> AsyncEngine:
    url = make_url(database_url)
    if url.database and url.database != ":memory:":
        path = Path(url.database).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        private_file(path)
    # The pool lends the connection returned last (LIFO), not the one idle
    # longest: its thread and SQLite's caches are still warm. On a worker
    # under load, a run's CPU fell by about 7% (bench/README, "What was
    # cut"). Its size stays SQLAlchemy's default: keeping every connection
    # open (15), or capping them at 5 or 3, each cost more than it saved.
    lifo = {"pool_use_lifo": True} if url.database and url.database != ":memory:" else {}
    engine = create_async_engine(
        database_url,
        hide_parameters=True,
        json_serializer=dumps_storable,
        # One trip to aiosqlite's thread per statement (sqlite_driver.py).
        connect_args={"async_creator_fn": sqlite_driver.connect},
        **lifo,
    )

    # SQLAlchemy's documented recipe: stop pysqlite from managing transactions
    # and emit BEGIN IMMEDIATE ourselves. A deferred transaction that reads and
    # then writes fails with SQLITE_BUSY whatever the timeout; an immediate one
    # waits its turn.
    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        wal = cursor.fetchone()[0] == "wal"
        # In WAL mode the driver runs a call on the event loop while the
        # connection's thread is idle, and the event loop must never wait
        # for a lock: there the connection's own timeout is 0, and the
        # driver's thread waits as long as this says (sqlite_driver.py).
        cursor.execute(f"PRAGMA busy_timeout={0 if wal else SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()
        if wal and not sqlite_driver.run_here_when_idle(dbapi_connection, SQLITE_BUSY_TIMEOUT_MS):
            cursor = dbapi_connection.cursor()  # another driver's: it waits itself
            cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        # Readers (see read_only_engine) need no write lock: WAL lets them run
        # beside a writer. Everything else takes the write lock up front.
        read_only = conn.get_execution_options().get(READ_ONLY_OPTION, False)
        refuse_writes(conn.connection.driver_connection, read_only)
        conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

    @event.listens_for(engine.sync_engine, "checkin")
    def _on_checkin(dbapi_connection: Any, _record: Any) -> None:
        # Back in the pool, a connection takes writes again: its next
        # borrower may be one that asks nothing (the driver sends the
        # PRAGMA with that borrower's first statement, if it was refusing).
        if dbapi_connection is not None:
            refuse_writes(dbapi_connection.driver_connection, False)

    return engine


def refuse_writes(driver: Any, read_only: bool) -> None:
    """Ask SQLite to refuse writes on ``driver``'s connection (a reader's) or
    take them (a writer's), from its next statement on; nothing on
    aiosqlite's own driver, which tests compare against. A write sent
    through a reader (a bug of ours) would otherwise commit outside the
    writers' lock and audit, as PostgreSQL's READ ONLY refuses it
    (:func:`read_only_engine`)."""
    if isinstance(driver, sqlite_driver.OneTripConnection):
        driver.reading = read_only


def private_file(path: Path) -> None:
    """Create a database file readable only by its owner, before SQLite does
    (which would use the umask, usually 0644). SQLite gives its -wal and -shm
    files the database file's mode. An existing file is left as it is."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass  # someone else's: its mode is theirs to keep


def read_only_engine(engine: AsyncEngine) -> AsyncEngine:
    """The same pool, marked so that SQLite opens its transactions deferred;
    on PostgreSQL, READ ONLY transactions as well: a write sent through a
    reader (a bug, or rows locked FOR UPDATE) is refused by the server, not
    committed outside the writers' run lock and audit. The flag goes with
    the BEGIN (with the ping's, pg_core.begun: no trip of its own), and
    SQLAlchemy takes it off the connection when the pool has it back. Every
    BEGIN is checked to say it (:func:`_refuse_unless_read_only`)."""
    if engine.dialect.name != "postgresql":
        readers = engine.execution_options(**{READ_ONLY_OPTION: True})
        # A reader's from its checkout, before any BEGIN (whose listener
        # says it again: a connection replaced inside the block is fresh).
        event.listen(readers.sync_engine, "engine_connect", _reading_from_checkout)
        return readers
    readers = engine.execution_options(**{READ_ONLY_OPTION: True, "postgresql_readonly": True})
    event.listen(readers.sync_engine, "begin", _refuse_unless_read_only)
    return readers


def _reading_from_checkout(conn: Any) -> None:
    refuse_writes(conn.connection.driver_connection, True)


def _refuse_unless_read_only(conn: Any) -> None:
    """A reader's BEGIN, refused unless it begins a READ ONLY transaction.
    SQLAlchemy marks a connection read-only once, when a reader's block
    takes it: one it checks out again inside the block (after the first was
    invalidated) is not marked, and under AUTOCOMMIT no BEGIN goes to carry
    the flag. Either way the reader would take writes (found by the review
    of the flag). Nothing is sent: the adapter's own flags are read. The
    connection is closed before the refusal (its pooled connection goes
    back, rolled back): SQLAlchemy, its BEGIN cut off here, would send the
    next statement without one, and no check (found by the second review)."""
    adapted = conn.connection.dbapi_connection
    if adapted.autocommit or not adapted.readonly:
        conn.close()
        raise InvalidRequestError(
            "a reader's transaction would not be read-only (its connection was "
            "replaced inside its block, or the engine is under AUTOCOMMIT)"
        )


def is_postgresql(session: AsyncSession | CoreConnection) -> bool:
    dialect = session.bind.dialect if isinstance(session, AsyncSession) else session.dialect
    return dialect.name == "postgresql"


def insert_for(session: AsyncSession | CoreConnection, table: Any) -> Any:
    """The dialect's INSERT, which has ``on_conflict_do_*`` on both databases."""
    return dialect_insert(is_postgresql(session), table)


def dialect_insert(on_postgresql: bool, table: Any) -> Any:
    """:func:`insert_for` by the dialect's name, for statements built once."""
    return (postgresql.insert if on_postgresql else sqlite.insert)(table)


async def database_now(session: AsyncSession | CoreConnection) -> datetime:
    """The database's clock, for lease and approval deadlines.

    PostgreSQL: ``clock_timestamp()`` (``now()`` is the transaction's start,
    stale after a lock wait). SQLite runs in this process, so its clock is ours.
    """
    if is_postgresql(session):
        value = (await session.execute(_READ_THE_CLOCK)).scalar_one()
        return value.astimezone(UTC)
    return datetime.now(UTC)


async def database_now_under_write_lock(session: AsyncSession | CoreConnection) -> datetime:
    """:func:`database_now` for a deadline judged by the statement that
    follows, in a transaction that has sent nothing yet. On SQLite the write
    lock is taken by BEGIN IMMEDIATE, which goes with the first statement
    (sqlite_driver.py): one statement takes it first, so the clock is read
    after any wait for another process's lock, not before it (stale by the
    wait, it judged a lease that lapsed meanwhile still live)."""
    if not is_postgresql(session):
        await session.execute(_TAKE_THE_WRITE_LOCK)
    return await database_now(session)


# Built once: a hot path's fast connection keeps its compiled form by the
# statement object (core_statements.py).
_TAKE_THE_WRITE_LOCK = select(literal(1))
_READ_THE_CLOCK = text("SELECT clock_timestamp()")


def database_clock(session: AsyncSession) -> Any | None:
    """On PostgreSQL, ``clock_timestamp()`` as an SQL expression, evaluated
    where the statement uses it (after its row locks); None on SQLite, whose
    clock is this process's and whose writers are already serialised."""
    if is_postgresql(session):
        return func.clock_timestamp()
    return None
