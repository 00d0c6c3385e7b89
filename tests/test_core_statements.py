"""What both fast connections (roundtable/store/core_statements.py: SQLite's
in sqlite_core.py, PostgreSQL's in pg_core.py) promise alike, held to
SQLAlchemy's own execution on the same engine, on both databases: the values
stored and read, rows and results, errors. What each does on its own is in
tests/test_sqlite_core.py and tests/test_pg_core.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    event,
    exc,
    func,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.ext.asyncio import AsyncEngine

from roundtable.store import open_store, pg_core, sqlite_core
from roundtable.store.core_statements import CoreStatements
from roundtable.store.database import Database
from roundtable.store.engine import create_engine_for
from roundtable.store.errors import InvalidInputError
from roundtable.store.schema import Base, JSONValue, UTCDateTime

META = MetaData()
# Every column type the store's tables use, nullable, and one Python default
# (which a fast connection must refuse to imitate).
KINDS = Table(
    "kinds",
    META,
    Column("id", String(36), primary_key=True),
    Column("name", String(255), unique=True),
    Column("body", Text),
    Column("small", Integer),
    Column("big", BigInteger),
    Column("flag", Boolean),
    Column("at", UTCDateTime()),
    Column("doc", JSONValue),
    Column("counted", Integer, default=0),
)
NOW = datetime(2026, 12, 4, 19, 30, 1, 123456, tzinfo=UTC)


def kind_row(key: str, **changes: Any) -> dict[str, Any]:
    row = {
        "id": key,
        "name": f"name-{key}",
        "body": "ünïcode ✓ and 'quotes'",
        "small": -7,
        "big": 2**40,
        "flag": True,
        "at": NOW,
        "doc": {"list": [1, 2.5, None, "x"], "nested": {"t": True}},
        "counted": 3,
    }
    return {**row, **changes}


@dataclass
class Side:
    """One database, its engine with ``kinds`` created, and how the store
    opens a fast writing transaction and a fast reader there."""

    url: str
    engine: AsyncEngine
    fast: Callable[[], contextlib.AbstractAsyncContextManager[Any]]
    reading: Callable[[], contextlib.AbstractAsyncContextManager[Any]]


@pytest.fixture
async def side(database_url: str) -> AsyncIterator[Side]:
    """Each database in turn (conftest's ``database_url``)."""
    url = database_url
    on_sqlite = url.startswith("sqlite")
    engine = create_engine_for(url)
    async with engine.begin() as conn:
        await conn.run_sync(META.create_all)

    def fast() -> contextlib.AbstractAsyncContextManager[Any]:
        return store_transaction(engine)

    def reading() -> contextlib.AbstractAsyncContextManager[Any]:
        if on_sqlite:
            return sqlite_core.reading(engine)
        return pg_core.reading(engine)

    yield Side(url, engine, fast, reading)
    await engine.dispose()


@contextlib.asynccontextmanager
async def store_transaction(engine: AsyncEngine) -> AsyncIterator[Any]:
    """A writing transaction on the fast connection, as the store opens one."""
    db = Database(engine)
    try:
        async with db.core_transaction() as (conn, _):
            assert isinstance(conn, CoreStatements)
            yield conn
    finally:
        await db.close()


async def cancelled_inside(
    opening: Callable[[], contextlib.AbstractAsyncContextManager[Any]],
    write: Callable[[Any], Any],
) -> None:
    """A transaction (``opening()``) cancelled while it waits, after
    ``write(conn)``."""
    inside = asyncio.Event()

    async def cancelled() -> None:
        async with opening() as conn:
            await write(conn)
            inside.set()
            await asyncio.sleep(60)

    task = asyncio.create_task(cancelled())
    await inside.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def both_read(
    engine: AsyncEngine,
    reading: Callable[[], contextlib.AbstractAsyncContextManager[Any]],
    statement: Any,
    params: Any = None,
) -> tuple[list, list]:
    """The rows a read gives through SQLAlchemy and through a fast reader,
    each value with its key and type."""

    def typed(result: Any) -> list:
        keys = list(result.keys())
        return [[(k, v, type(v)) for k, v in zip(keys, row, strict=True)] for row in result]

    async with engine.connect() as conn:
        theirs = typed(await conn.execute(statement, params))
    async with reading() as conn:
        assert isinstance(conn, CoreStatements)
        ours = typed(await conn.execute(statement, params))
    return theirs, ours


async def test_values_are_stored_and_read_as_sqlalchemy_stores_and_reads_them(side) -> None:
    # Written by each path, read by both: the same values, of the same types.
    async with side.engine.begin() as conn:
        await conn.execute(insert(KINDS), kind_row("theirs"))
    async with side.fast() as conn:
        await conn.execute(insert(KINDS), kind_row("ours"))
        await conn.execute(
            insert(KINDS),
            kind_row(
                "nulls", name=None, body=None, small=None, big=None, flag=None, at=None, doc=None
            ),
        )
    for key in ("theirs", "ours", "nulls"):
        query = select(KINDS).where(KINDS.c.id == key)
        theirs, ours = await both_read(side.engine, side.reading, query)
        assert theirs == ours and len(ours) == 1, key
    # Aware UTC datetimes out, from any zone in; JSON as JSON; bools as bools.
    async with side.fast() as conn:
        row = (await conn.execute(select(KINDS).where(KINDS.c.id == "ours"))).one()
    assert row.at == NOW and row.at.tzinfo is UTC
    assert row.flag is True and row.doc["nested"] == {"t": True}
    # The raw text stored is the same as SQLAlchemy's.
    raw = select(func.cast(KINDS.c.at, Text), func.cast(KINDS.c.doc, Text)).order_by(KINDS.c.id)
    theirs, ours = await both_read(side.engine, side.reading, raw)
    assert theirs == ours


async def test_the_store_tables_read_alike_after_a_run_s_opening(side) -> None:
    async with open_store(side.url) as store:
        await store.runs.ensure(run_id="run-1", user_id="user-1", task_text="a task ✓")
        await store.runs.pin_snapshot("run-1", "d" * 64, status="running", body='{"tools": []}')
        await store.runs.set_status("run-1", "waiting_input")
        seen = 0
        for table in Base.metadata.sorted_tables:
            theirs, ours = await both_read(store.engine, side.reading, select(table))
            assert theirs == ours, table.name
            seen += len(ours)
        assert seen >= 6  # a session, a run, its events, the snapshot


async def test_errors_are_sqlalchemys_own_with_their_values_hidden(side) -> None:
    secret = "s3cr3t-value"
    async with side.engine.begin() as conn:
        await conn.execute(insert(KINDS), kind_row("taken", body=secret))
    theirs: Exception | None = None
    try:
        async with side.engine.begin() as conn:
            await conn.execute(insert(KINDS), kind_row("taken", body=secret))
    except exc.IntegrityError as error:
        theirs = error
    with pytest.raises(exc.IntegrityError) as ours:
        async with side.fast() as conn:
            await conn.execute(insert(KINDS), kind_row("fresh", body=secret))
            await conn.execute(insert(KINDS), kind_row("taken", body=secret))
    assert theirs is not None and type(ours.value.orig) is type(theirs.orig)
    assert str(ours.value.orig) == str(theirs.orig)
    assert secret not in str(ours.value) and "hidden" in str(ours.value)
    # Rolled back whole: the first insert went with it.
    async with side.fast() as conn:
        assert (await conn.execute(select(KINDS.c.id))).scalars().all() == ["taken"]
    # A statement the database refuses: the class SQLAlchemy raises for it.
    missing = select(Column("missing", Integer)).select_from(KINDS)
    with pytest.raises(exc.DBAPIError) as sqlalchemy_s:
        async with side.engine.connect() as conn:
            await conn.execute(missing)
    with pytest.raises(exc.DBAPIError) as fast_s:
        async with side.fast() as conn:
            await conn.execute(missing)
    assert type(fast_s.value) is type(sqlalchemy_s.value)
    assert type(fast_s.value.orig) is type(sqlalchemy_s.value.orig)


async def test_a_value_its_type_refuses_is_sqlalchemy_s_statement_error(side) -> None:
    naive = kind_row("naive", at=datetime(2026, 12, 4, 12, 0))  # no zone
    with pytest.raises(exc.StatementError) as ours:
        async with side.fast() as conn:
            await conn.execute(insert(KINDS), naive)
    with pytest.raises(exc.StatementError) as theirs:
        async with side.engine.begin() as conn:
            await conn.execute(insert(KINDS), naive)
    assert type(ours.value.orig) is type(theirs.value.orig) is ValueError
    assert "naive" in str(ours.value) and "hidden" in str(ours.value)


async def test_unstorable_text_is_refused_before_it_is_sent(side) -> None:
    sent: list[str] = []
    event.listen(side.engine.sync_engine, "after_cursor_execute", lambda *a: sent.append(a[2]))
    with pytest.raises(InvalidInputError):
        async with side.fast() as conn:
            await conn.execute(insert(KINDS), kind_row("nul", body="a\x00b"))
    assert not any("INSERT" in sql for sql in sent)
    async with side.fast() as conn:
        assert (await conn.execute(select(KINDS.c.id))).all() == []


async def test_rows_answer_as_sqlalchemy_rows_do(side) -> None:
    async with side.fast() as conn:
        await conn.execute(insert(KINDS), [kind_row("a") | {"name": "a"}, kind_row("b")])
        rows = await conn.execute(select(KINDS.c.id, KINDS.c.at).order_by(KINDS.c.id))
        first = rows.first()
        assert first is not None
        assert first._mapping == {"id": "a", "at": NOW} == first._asdict()
        assert (first.id, first[1]) == ("a", NOW)
        with pytest.raises(AttributeError):
            _ = first.missing
        with pytest.raises(exc.MultipleResultsFound):
            rows.one_or_none()
        with pytest.raises(exc.MultipleResultsFound):
            rows.scalar_one()
        empty = await conn.execute(select(KINDS.c.id).where(KINDS.c.id == "none"))
        assert empty.scalar() is None and empty.scalar_one_or_none() is None
        with pytest.raises(exc.NoResultFound):
            empty.one()
        assert rows.mappings().all() == [{"id": "a", "at": NOW}, {"id": "b", "at": NOW}]
    assert timedelta(0) == NOW - first.at


# What an adversarial review found SQLite's fast path did unlike SQLAlchemy,
# none of it reached by the store's own calls, each now as SQLAlchemy does it.


async def test_a_textual_read_gives_its_rows_named_by_the_cursor(side) -> None:
    async with side.fast() as conn:
        await conn.execute(insert(KINDS), kind_row("a"))
    statement = text("SELECT id, small, flag FROM kinds")
    theirs, ours = await both_read(side.engine, side.reading, statement)
    assert ours == theirs and [key for key, _, _ in ours[0]] == ["id", "small", "flag"]
    assert [value for _, value, _ in ours[0]][:2] == ["a", -7]


async def test_a_statement_that_returns_no_rows_refuses_to_be_asked_for_them(side) -> None:
    async with side.fast() as conn:
        changed = await conn.execute(update(KINDS).values(small=1))
        assert changed.rowcount == 0 and not changed.returns_rows
        for ask in ("all", "first", "one_or_none", "scalar_one_or_none", "scalars"):
            with pytest.raises(exc.ResourceClosedError):
                getattr(changed, ask)()


async def test_scalars_and_mappings_answer_as_sqlalchemy_s(side) -> None:
    async with side.fast() as conn:
        await conn.execute(insert(KINDS), [kind_row("a") | {"name": "a"}, kind_row("b")])
        two = await conn.execute(select(KINDS.c.id))
        with pytest.raises(exc.MultipleResultsFound):
            two.scalars().one()
        with pytest.raises(exc.MultipleResultsFound):
            two.scalars().one_or_none()
        none = await conn.execute(select(KINDS.c.id).where(KINDS.c.id == "x"))
        with pytest.raises(exc.NoResultFound):
            none.scalars().one()
        row = (await conn.execute(select(KINDS.c.id).where(KINDS.c.id == "a"))).one()
        assert row._mapping[KINDS.c.id] == row._mapping["id"] == "a"
        with pytest.raises(KeyError):
            row._mapping[KINDS.c.small]


async def test_a_row_found_by_column_object_answers_for_that_column_as_sqlalchemy_s(
    side,
) -> None:
    """Two tables' columns of one name are two columns: each answers with its
    own value; one not in the row, or in it twice, is refused; as
    SQLAlchemy's rows answer (a review found the first of the two answered
    for both)."""
    async with side.engine.begin() as conn:
        await conn.execute(insert(KINDS), [kind_row("a"), kind_row("z", name="zz", small=99)])
    other = KINDS.alias("other")
    statement = (
        select(KINDS.c.small, other.c.small, KINDS.c.id, KINDS.c.id)
        .select_from(KINDS.join(other, other.c.id != KINDS.c.id))
        .where(KINDS.c.id == "a")
    )

    def answer(row: Any, key: Any) -> Any:
        try:
            return row._mapping[key]
        except Exception as error:
            return type(error)

    keys = [KINDS.c.small, other.c.small, KINDS.c.id, other.c.id, KINDS.c.body, "small"]
    async with side.engine.connect() as conn:
        theirs = (await conn.execute(statement)).one()
    async with side.reading() as conn:
        ours = (await conn.execute(statement)).one()
    assert [answer(ours, key) for key in keys] == [answer(theirs, key) for key in keys]
    assert answer(ours, other.c.small) == 99 and answer(ours, KINDS.c.small) == -7


async def test_a_connection_kept_past_its_block_refuses_statements(side) -> None:
    """Its statements would run on a connection the pool has taken back:
    outside any transaction, or inside another borrower's."""
    async with side.fast() as kept:
        await kept.execute(insert(KINDS), kind_row("a"))
    with pytest.raises(exc.ResourceClosedError):
        await kept.execute(update(KINDS).values(small=2))
    async with side.reading() as reader:
        pass
    with pytest.raises(exc.ResourceClosedError):
        await reader.execute(select(KINDS.c.id))
    async with side.engine.connect() as conn:
        assert (await conn.execute(select(KINDS.c.small))).scalars().all() == [-7]


async def test_a_statement_built_again_finds_its_own_column_objects(side) -> None:
    """An equal statement built again (per call) shares the first one's
    compiled form, whose result columns name the first one's objects: the
    second's own label, alias column and function still answer, as
    SQLAlchemy's rows do (it adapts its result to the statement run)."""
    async with side.engine.begin() as conn:
        await conn.execute(insert(KINDS), kind_row("a"))
    for _ in range(2):
        label = KINDS.c.id.label("the_id")
        alias = KINDS.alias("again")
        counted = func.count(KINDS.c.id)
        statement = (
            select(label, alias.c.small, counted)
            .select_from(KINDS.join(alias, alias.c.id == KINDS.c.id))
            .group_by(KINDS.c.id, alias.c.small)
        )
        async with side.engine.connect() as conn:
            theirs = (await conn.execute(statement)).one()._mapping
        async with side.reading() as conn:
            ours = (await conn.execute(statement)).one()._mapping
        for key in (label, alias.c.small, counted, "the_id"):
            assert ours[key] == theirs[key]
            assert (key in ours) and ours.get(key) == theirs.get(key)
        assert KINDS.c.body not in ours and ours.get(KINDS.c.body, "none") == "none"
