"""On SQLite the store's readers refuse writes, as PostgreSQL's server does
(tests/test_pg_read_only_readers.py): a write sent through a reader (a bug
of ours) would otherwise commit outside the writers' lock and audit. SQLite
refuses it itself (``PRAGMA query_only``), asked for by the connection's
borrower and sent only when a connection changes hands between a reader and
a writer, in the trip of the statement after (sqlite_driver.py): a kept
reader's or the held writer's connection sends it once, not at every read."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from roundtable.store import Store, open_store
from roundtable.store.sqlite_driver import OneTripConnection
from tests.test_held_writer_connection import committed as rows
from tests.test_held_writer_connection import pools_of
from tests.test_pg_read_only_readers import READERS
from tests.test_pg_read_only_readers import reading as reading_from

WRITES = (
    "INSERT INTO t VALUES ('written')",
    "UPDATE t SET v = 'changed'",
    "DELETE FROM t",
    "WITH w AS (SELECT 'cte') INSERT INTO t SELECT * FROM w",
    "CREATE TABLE u (x)",
)
# What SQLite's query_only lets through (found by the review of it): a
# reader may not take the file out of WAL mode, which the driver relies on,
# attach another file, or turn the refusal off.
PRAGMAS_AND_ATTACH = (
    "PRAGMA journal_mode=DELETE",
    "PRAGMA busy_timeout = 1500",
    "PRAGMA wal_checkpoint(TRUNCATE)",
    "PRAGMA query_only = 0",
    "PRAGMA foreign_keys = OFF",
    "ATTACH DATABASE ':memory:' AS other",
)
REFUSED = "readonly database|not authorized"


@contextlib.asynccontextmanager
async def opened(tmp_path: Path) -> AsyncIterator[Store]:
    async with open_store(f"sqlite+aiosqlite:///{tmp_path / 'read-only.db'}") as made:
        raw = sqlite3.connect(made.engine.url.database, isolation_level=None)
        raw.execute("CREATE TABLE t (v TEXT)")
        raw.execute("INSERT INTO t VALUES ('first')")
        raw.close()
        yield made


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    async with opened(tmp_path) as made:
        yield made


@pytest.fixture
async def one_connection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Store]:
    """A store whose pool has one connection: nothing is kept or held, so
    every reader and writer below is lent that one, in turn."""
    pools_of(monkeypatch, 1)
    async with opened(tmp_path) as made:
        yield made


def outside(store: Store, sql: str) -> list[Any]:
    """What another process reads."""
    raw = sqlite3.connect(store.engine.url.database, isolation_level=None)
    try:
        return raw.execute(sql).fetchall()
    finally:
        raw.close()


def tables(store: Store) -> list[str]:
    return [n for (n,) in outside(store, "SELECT name FROM sqlite_master WHERE type = 'table'")]


async def write_as_writers(store: Store, value: str) -> None:
    """The same row written by each of the writers' ways (Core, ORM, and the
    engine's own connections), each a value of its own."""
    async with store.db.core_transaction() as (conn, _notes):
        await conn.execute(text("INSERT INTO t VALUES (:v)"), {"v": f"{value}-core"})
    async with store.db.transaction() as session:
        await session.execute(text("INSERT INTO t VALUES (:v)"), {"v": f"{value}-orm"})
    async with store.engine.begin() as plain:
        await plain.execute(text("INSERT INTO t VALUES (:v)"), {"v": f"{value}-engine"})


@pytest.mark.parametrize("statement", WRITES)
@pytest.mark.parametrize("way", READERS)
async def test_a_write_through_a_reader_is_refused_and_changes_nothing(
    store: Store, way: str, statement: str
) -> None:
    with pytest.raises(DBAPIError, match="readonly database"):
        async with reading_from(store.db, way) as reader:
            await reader.execute(text(statement))
    assert rows(store) == ["first"]
    assert "u" not in tables(store)


@pytest.mark.parametrize("statement", PRAGMAS_AND_ATTACH)
@pytest.mark.parametrize("way", READERS)
async def test_a_reader_can_neither_set_a_pragma_nor_attach(
    store: Store, way: str, statement: str
) -> None:
    """Each refused, on a fresh store (where a lone read could take the file
    out of WAL mode), and a write after it refused still."""
    with pytest.raises(DBAPIError, match=REFUSED):
        async with reading_from(store.db, way) as reader:
            await reader.execute(text(statement))
    with pytest.raises(DBAPIError, match="readonly database"):
        async with reading_from(store.db, way) as reader:
            await reader.execute(text("INSERT INTO t VALUES ('after')"))
    assert outside(store, "PRAGMA journal_mode") == [("wal",)]
    assert rows(store) == ["first"]


async def test_the_driver_still_sets_a_readers_busy_timeout_on_the_thread(store: Store) -> None:
    """The busy timeout SQLite's thread waits for a lock with is set around
    each call it runs, on a reader's connection too (the one PRAGMA a
    reader's connection takes, and from the driver alone)."""
    async with reading_from(store.db, "core_reader") as reader:
        await reader.execute(text("SELECT 1"))
    (kept,) = kept_readers(store)
    assert kept._query_only
    sent = traced(kept)
    await kept.execute("SELECT 1")  # aiosqlite's own call: on the thread
    assert sent == ["PRAGMA busy_timeout = 60000", "SELECT 1", "PRAGMA busy_timeout = 0"]


@pytest.mark.parametrize("way", READERS)
async def test_a_reader_still_reads(store: Store, way: str) -> None:
    async with reading_from(store.db, way) as reader:
        seen = (await reader.execute(text("SELECT v FROM t"))).scalars().all()
    assert seen == ["first"]


@pytest.mark.parametrize("way", READERS)
async def test_one_connection_lent_in_turn_refuses_only_its_readers(
    one_connection: Store, way: str
) -> None:
    """A reader, then writers of every kind lent the same connection: they
    write; a reader after them refuses again; writers after that write."""
    store = one_connection
    with pytest.raises(DBAPIError, match="readonly database"):
        async with reading_from(store.db, way) as reader:
            await reader.execute(text("INSERT INTO t VALUES ('reader-1')"))
    await write_as_writers(store, "after-1")
    with pytest.raises(DBAPIError, match="readonly database"):
        async with reading_from(store.db, way) as reader:
            await reader.execute(text("INSERT INTO t VALUES ('reader-2')"))
    await write_as_writers(store, "after-2")
    assert rows(store) == [
        "first",
        *(f"after-{n}-{kind}" for n in (1, 2) for kind in ("core", "orm", "engine")),
    ]
    assert store.engine.sync_engine.pool.checkedout() == 0


async def test_a_borrower_that_asks_nothing_is_lent_a_connection_that_writes(
    one_connection: Store,
) -> None:
    """A reader's connection back in the pool takes writes again, as a fresh
    one does, for a borrower that neither begins through the engine nor is
    one of the store's (one that uses the driver itself)."""
    store = one_connection
    async with reading_from(store.db, "core_reader") as reader:
        await reader.execute(text("SELECT 1"))
    async with store.engine.connect() as conn:
        driver = (await conn.get_raw_connection()).driver_connection
        await driver.execute("INSERT INTO t VALUES ('raw')")  # autocommit: alone
    assert rows(store) == ["first", "raw"]


async def test_the_readers_engine_refuses_a_write_sent_to_its_driver(store: Store) -> None:
    """A connection of the readers' engine is a reader's from its checkout,
    before any BEGIN: a write sent to its driver directly is refused too."""
    async with store.db._readers.connect() as conn:
        driver = (await conn.get_raw_connection()).driver_connection
        with pytest.raises(sqlite3.OperationalError, match="readonly database"):
            await driver.execute("INSERT INTO t VALUES ('raw-through-readers')")
    assert rows(store) == ["first"]


async def test_a_connection_closes_without_a_statement_before(one_connection: Store) -> None:
    """A reader's connection the pool then closes (disposed of) is closed as
    it is, the refusal not turned off first: a statement failing there would
    leave it open."""
    store = one_connection
    async with store.engine.connect() as conn:
        driver = (await conn.get_raw_connection()).driver_connection
    async with reading_from(store.db, "core_reader") as reader:
        await reader.execute(text("SELECT 1"))
    sent = traced(driver)
    await store.engine.dispose()
    assert [s for s in sent if "query_only" in s] == []
    assert driver._connection is None


async def test_the_engine_under_autocommit_refuses_a_readers_write(
    one_connection: Store,
) -> None:
    """Under AUTOCOMMIT each statement commits alone: a reader's write there
    would commit at once, so it must be refused before it runs."""
    store = one_connection
    with pytest.raises(DBAPIError, match="readonly database"):
        async with store.db._readers.execution_options(isolation_level="AUTOCOMMIT").connect() as c:
            await c.execute(text("INSERT INTO t VALUES ('autocommitted')"))
    assert rows(store) == ["first"]


@pytest.mark.filterwarnings("ignore:transaction already deassociated:sqlalchemy.exc.SAWarning")
async def test_a_reader_whose_connection_is_replaced_mid_block_still_refuses(
    store: Store,
) -> None:
    """A connection invalidated under a reader's session and used again is a
    fresh one, which nobody asked to refuse writes but its BEGIN."""
    with pytest.raises(DBAPIError, match="readonly database"):
        async with store.db.reader() as session:
            conn = await session.connection()
            await conn.execute(text("SELECT 1"))
            await conn.invalidate()
            await conn.rollback()
            await conn.execute(text("INSERT INTO t VALUES ('replaced')"))
            await conn.commit()
    assert rows(store) == ["first"]


async def test_a_writer_after_a_reader_never_waits_for_a_lock_on_the_event_loop(
    one_connection: Store,
) -> None:
    """The event loop must never wait for SQLite's lock (sqlite_driver.py):
    a connection lent to a writer after a reader has its busy timeout at 0
    on the event loop, whatever the reader left (found by the second review:
    a reader's busy timeout stayed, and a writer meeting another process's
    lock held the event loop for it)."""
    store = one_connection
    async with store.engine.connect() as conn:
        driver = (await conn.get_raw_connection()).driver_connection
    async with reading_from(store.db, "core_reader") as reader:
        await reader.execute(text("SELECT 1"))
    assert driver._query_only
    # Left behind (a reader's own PRAGMA is refused; a cached statement of
    # this driver's text would not be asked again).
    driver._busy_timeout(1500)
    async with store.db.core_transaction() as (conn, _notes):
        await conn.execute(text("INSERT INTO t VALUES ('writer')"))
    assert driver._conn.execute("PRAGMA busy_timeout").fetchone() == (0,)
    assert rows(store) == ["first", "writer"]


def kept_readers(store: Store) -> list[OneTripConnection]:
    readers = store.db.reader_connections
    assert readers is not None
    return readers.drivers


def traced(driver: OneTripConnection) -> list[str]:
    """Every statement SQLite runs on ``driver``'s connection from now on."""
    sent: list[str] = []
    driver._conn.set_trace_callback(sent.append)
    return sent


async def test_kept_readers_and_the_held_writer_switch_once(store: Store) -> None:
    """The refusal costs no statement per read: a kept reader's connection
    is asked once, the held writer's never (a fresh connection takes writes)."""
    await write_as_writers(store, "warm")  # the writer's connection, held
    async with reading_from(store.db, "core_reader_alone") as reader:
        await reader.execute(text("SELECT 1"))  # a reader's, kept
    readers = store.db.reader_connections
    writer = store.db.writer_connection
    assert readers is not None and writer is not None and writer.driver is not None
    (kept,) = readers.drivers
    to_reader, to_writer = traced(kept), traced(writer.driver)
    for n in range(5):
        for way in ("core_reader", "core_reader_alone"):
            async with reading_from(store.db, way) as reader:
                await reader.execute(text("SELECT v FROM t"))
        async with store.db.core_transaction() as (conn, _notes):
            await conn.execute(text("INSERT INTO t VALUES (:v)"), {"v": f"held-{n}"})
    assert [s for s in to_reader + to_writer if "query_only" in s] == []
    # The statements only: BEGIN, SELECT, ROLLBACK and a lone SELECT; BEGIN
    # IMMEDIATE, INSERT, COMMIT.
    assert (len(to_reader), len(to_writer)) == (5 * 4, 5 * 3)
