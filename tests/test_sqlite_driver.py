"""The SQLite driver's cursor (roundtable/store/sqlite_driver.py): one trip
to aiosqlite's thread per statement, and the same answers SQLAlchemy got
from aiosqlite's own cursor: rows, row counts, last row ids, errors, and
transactions that commit or roll back whole."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from roundtable.store.engine import create_engine_for
from roundtable.store.sqlite_driver import OneTripConnection


@pytest.fixture
async def engine(tmp_path) -> AsyncIterator[AsyncEngine]:
    made = create_engine_for(f"sqlite+aiosqlite:///{tmp_path / 'driver.db'}")
    async with made.begin() as conn:
        await conn.execute(text("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT UNIQUE)"))
    yield made
    await made.dispose()


@pytest.fixture
def trips(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every call queued for a connection's thread, by name."""
    seen: list[str] = []
    queue = OneTripConnection._execute

    async def counted(self, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(getattr(fn, "__name__", repr(fn)))
        return await queue(self, fn, *args, **kwargs)

    monkeypatch.setattr(OneTripConnection, "_execute", counted)
    return seen


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
