"""The SQLite driver's cursor (roundtable/store/sqlite_driver.py): one trip
to aiosqlite's thread per statement, and the same answers SQLAlchemy got
from aiosqlite's own cursor: rows, row counts, last row ids, errors, and
transactions that commit or roll back whole."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from roundtable.store.engine import create_engine_for


@pytest.fixture
async def engine(tmp_path) -> AsyncIterator[AsyncEngine]:
    made = create_engine_for(f"sqlite+aiosqlite:///{tmp_path / 'driver.db'}")
    async with made.begin() as conn:
        await conn.execute(text("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT UNIQUE)"))
    yield made
    await made.dispose()


async def test_a_statement_is_one_trip_with_its_rows_and_counts(engine, trips) -> None:
    async with engine.connect() as conn:
        await conn.execute(text("SELECT 1"))  # the pool's connection is open now
        trips.clear()
        inserted = await conn.execute(text("INSERT INTO t (v) VALUES ('a'), ('b'), ('c')"))
        assert inserted.rowcount == 3 and inserted.lastrowid == 3
        changed = await conn.execute(text("UPDATE t SET v = v || '!' WHERE id >= 2"))
        assert changed.rowcount == 2
        none = await conn.execute(text("UPDATE t SET v = 'x' WHERE id = 99"))
        assert none.rowcount == 0
        returned = await conn.execute(text("DELETE FROM t WHERE id = 1 RETURNING v"))
        assert returned.all() == [("a",)]
        rows = await conn.execute(text("SELECT id, v FROM t ORDER BY id"))
        assert rows.keys() == ["id", "v"]
        assert rows.fetchone() == (2, "b!")
        assert rows.fetchall() == [(3, "c!")]
        assert trips == ["_run"] * 5  # aiosqlite's own cursor took four trips each
        await conn.commit()


async def test_many_parameter_sets_and_errors_come_through(engine) -> None:
    async with engine.connect() as conn:
        await conn.execute(text("INSERT INTO t (v) VALUES (:v)"), [{"v": "p"}, {"v": "q"}])
        with pytest.raises(IntegrityError):
            await conn.execute(text("INSERT INTO t (v) VALUES ('p')"))
        await conn.rollback()
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM t"))).scalar_one() == 0


async def test_a_transaction_commits_whole_or_not_at_all(engine) -> None:
    with pytest.raises(IntegrityError):
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO t (v) VALUES ('kept?')"))
            await conn.execute(text("INSERT INTO t (v) VALUES ('kept?')"))
    async with engine.begin() as conn:
        await conn.execute(text("INSERT INTO t (v) VALUES ('kept')"))
    async with engine.connect() as conn:
        values = (await conn.execute(text("SELECT v FROM t"))).scalars().all()
    assert values == ["kept"]


async def test_a_transaction_is_its_statements_and_its_commit(engine, trips) -> None:
    """BEGIN IMMEDIATE goes with the first statement, and the pool's rollback
    of a connection returned after its commit is not sent: nothing is left
    to roll back."""
    async with engine.begin() as conn:  # the pool's connection is open now
        await conn.execute(text("SELECT 1"))
    trips.clear()
    async with engine.begin() as conn:
        await conn.execute(text("INSERT INTO t (v) VALUES ('a')"))
        await conn.execute(text("UPDATE t SET v = 'b'"))
    assert trips == ["_run", "_run", "_ended"]  # were BEGIN, 2 statements, COMMIT, ROLLBACK
    trips.clear()
    async with engine.begin():
        pass  # BEGIN and COMMIT alone: nothing to send
    assert trips == []
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT v FROM t"))).scalars().all() == ["b"]
        raw = await conn.get_raw_connection()
        assert raw.driver_connection.in_transaction


async def test_the_write_lock_is_taken_with_the_first_statement(engine, tmp_path) -> None:
    """The held-back BEGIN IMMEDIATE is still BEGIN IMMEDIATE: once the
    first statement has run, another connection cannot write."""
    async with engine.begin() as conn:
        await conn.execute(text("SELECT 1"))
    other = sqlite3.connect(tmp_path / "driver.db", isolation_level=None, timeout=0)
    try:
        async with engine.begin() as conn:
            await conn.execute(text("SELECT count(*) FROM t"))  # a read, first
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("BEGIN IMMEDIATE")
        other.execute("BEGIN IMMEDIATE")  # released with the commit
        other.execute("ROLLBACK")
    finally:
        other.close()


async def test_a_rollback_is_sent_unless_nothing_can_be_open(engine, trips) -> None:
    """A failed statement's rollback is sent (it undoes the statements before
    it); so is a rollback after anything else was sent since the last end."""
    async with engine.begin() as conn:
        await conn.execute(text("SELECT 1"))
    trips.clear()
    with pytest.raises(IntegrityError):
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO t (v) VALUES ('once')"))
            await conn.execute(text("INSERT INTO t (v) VALUES ('once')"))
    assert trips == ["_run", "_run", "_ended"]  # the rollback, sent
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM t"))).scalar_one() == 0
        await conn.commit()
        raw = (await conn.get_raw_connection()).driver_connection
        trips.clear()
        await raw.execute("PRAGMA user_version")  # aiosqlite's own call: state unknown
        await raw.rollback()
        assert trips[-1] == "_ended"
        await raw.rollback()  # and now known: not sent
        assert trips[-1] == "_ended" and trips.count("_ended") == 1


async def test_a_cancelled_first_statement_is_rolled_back_behind_it(engine, tmp_path) -> None:
    """Cancelled while the BEGIN and its statement run on the thread: the
    rollback is queued behind them, so the pooled connection holds no
    transaction and no write lock (the cancellation attack in
    test_sqlite_driver_attacks.py covers later statements)."""
    async with engine.begin() as conn:
        await conn.execute(text("SELECT 1"))
    heavy = (
        "WITH RECURSIVE s(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM s WHERE x < 3000000) "
        "SELECT count(*) FROM s"
    )

    async def job() -> None:
        async with engine.begin() as conn:
            await conn.execute(text(heavy))

    task = asyncio.ensure_future(job())
    await asyncio.sleep(0.05)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    other = sqlite3.connect(
        tmp_path / "driver.db", isolation_level=None, timeout=60, check_same_thread=False
    )
    try:
        await asyncio.to_thread(other.execute, "BEGIN IMMEDIATE")
        other.execute("ROLLBACK")
    finally:
        other.close()
    async with engine.connect() as conn:
        raw = await conn.get_raw_connection()
        assert not raw.driver_connection.in_transaction


async def test_a_begin_is_held_back_only_where_it_cannot_fail(engine) -> None:
    """On a connection whose state is not known (here, a transaction opened
    by aiosqlite's own call), BEGIN is sent at once and fails at once, as
    before: held back, its failure could be lost with a commit that finds
    nothing sent."""
    async with engine.connect() as conn:
        raw = (await conn.get_raw_connection()).driver_connection
        await conn.commit()
        await raw.execute("BEGIN")
        with pytest.raises(sqlite3.OperationalError, match="within a transaction"):
            await raw.cursor().execute("BEGIN IMMEDIATE")
        await raw.rollback()
