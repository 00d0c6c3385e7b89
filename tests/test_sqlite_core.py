"""Core statements on SQLite's fast path (roundtable/store/sqlite_core.py)
against SQLAlchemy's own execution on the same engine: the same SQL, values
stored and read, errors, listeners told, and transactions that commit or roll
back whole, cancelled or not. What both databases' fast connections share
is held on both in tests/test_core_statements.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import (
    bindparam,
    event,
    exc,
    func,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import ColumnClause

from roundtable.store import core_statements, sqlite_core
from roundtable.store.engine import create_engine_for
from roundtable.store.errors import InvalidInputError
from tests.test_core_statements import KINDS as _KINDS
from tests.test_core_statements import META as _META
from tests.test_core_statements import NOW as _NOW
from tests.test_core_statements import both_read, cancelled_inside
from tests.test_core_statements import kind_row as _row


@pytest.fixture
async def engine(tmp_path) -> AsyncIterator[AsyncEngine]:
    made = create_engine_for(f"sqlite+aiosqlite:///{tmp_path / 'core.db'}")
    async with made.begin() as conn:
        await conn.run_sync(_META.create_all)
    yield made
    await made.dispose()


def fast(engine: AsyncEngine) -> Any:
    return sqlite_core.transaction(engine, "BEGIN IMMEDIATE")


async def _both(engine: AsyncEngine, statement: Any, params: Any = None) -> tuple[list, list]:
    return await both_read(engine, lambda: sqlite_core.reading(engine), statement, params)


async def test_statements_of_every_shape_the_store_sends(engine) -> None:
    async with fast(engine) as conn:
        # executemany, one trip of its own
        many = await conn.execute(
            insert(_KINDS), [_row(str(n)) | {"name": f"n{n}"} for n in range(5)]
        )
        assert many.rowcount == 5
        # values built into the statement, not passed
        await conn.execute(insert(_KINDS).values(**_row("built")))
        # UPDATE … RETURNING, and a row count
        returned = await conn.execute(
            update(_KINDS)
            .where(_KINDS.c.id == bindparam("row_id"))
            .values(small=bindparam("small"))
            .returning(_KINDS.c.id, _KINDS.c.small, _KINDS.c.at),
            {"row_id": "built", "small": 42},
        )
        assert [tuple(r) for r in returned] == [("built", 42, _NOW)]
        missed = await conn.execute(update(_KINDS).where(_KINDS.c.id == "nobody").values(small=1))
        assert missed.rowcount == 0
    # IN lists, expanding, passed and built in
    ids = ["0", "3", "built", "absent"]
    for statement, params in (
        (select(_KINDS.c.id, _KINDS.c.small).where(_KINDS.c.id.in_(ids)), None),
        (
            select(_KINDS.c.id).where(_KINDS.c.id.in_(bindparam("ids", expanding=True))),
            {"ids": ids},
        ),
        (select(func.count()).select_from(_KINDS), None),
        (select(_KINDS.c.id, (_KINDS.c.small + 1).label("next")).order_by(_KINDS.c.id), None),
    ):
        theirs, ours = await _both(engine, statement.order_by(None), params)
        assert sorted(theirs) == sorted(ours) and ours, statement


async def test_listeners_are_told_every_statement_the_begin_and_the_end(engine) -> None:
    told: list[tuple[str, str]] = []
    sync = engine.sync_engine
    event.listen(sync, "before_cursor_execute", lambda *a: told.append(("before", a[2])))
    event.listen(sync, "after_cursor_execute", lambda *a: told.append(("after", a[2])))
    event.listen(sync, "commit", lambda *_: told.append(("commit", "")))
    event.listen(sync, "rollback", lambda *_: told.append(("rollback", "")))
    async with fast(engine) as conn:
        await conn.execute(select(_KINDS.c.id))
    assert [kind for kind, _ in told] == ["before", "after", "before", "after", "commit"]
    assert told[0][1] == "BEGIN IMMEDIATE" and told[2][1].startswith("SELECT")
    told.clear()
    with pytest.raises(RuntimeError):
        async with fast(engine) as conn:
            raise RuntimeError("the caller's own failure")
    assert [kind for kind, _ in told] == ["before", "after", "rollback"]


async def test_a_commit_listener_that_raises_rolls_the_transaction_back(engine) -> None:
    def refuse(_conn: Any) -> None:
        raise RuntimeError("no commit")

    event.listen(engine.sync_engine, "commit", refuse)
    with pytest.raises(RuntimeError):
        async with fast(engine) as conn:
            await conn.execute(insert(_KINDS), _row("kept?"))
    event.remove(engine.sync_engine, "commit", refuse)
    async with fast(engine) as conn:
        assert (await conn.execute(select(_KINDS.c.id))).all() == []


async def test_what_it_would_not_do_as_sqlalchemy_does_it_refuses(engine) -> None:
    without_default = {k: v for k, v in _row("defaults").items() if k != "counted"}
    with pytest.raises(NotImplementedError, match="column defaults"):
        async with fast(engine) as conn:
            await conn.execute(insert(_KINDS), without_default)
    with pytest.raises(NotImplementedError, match="RETURNING"):
        async with fast(engine) as conn:
            await conn.execute(
                insert(_KINDS).returning(_KINDS.c.id), [_row("a") | {"name": "a"}, _row("b")]
            )
    async with fast(engine) as conn:
        assert (await conn.execute(select(_KINDS.c.id))).all() == []


async def test_a_cancelled_transaction_leaves_nothing_and_the_next_one_runs(engine) -> None:
    async def write(conn: Any) -> None:
        await conn.execute(insert(_KINDS), _row("cancelled"))

    await cancelled_inside(lambda: fast(engine), write)
    async with fast(engine) as conn:
        await conn.execute(insert(_KINDS), _row("next"))
    async with engine.connect() as conn:
        assert (await conn.execute(select(_KINDS.c.id))).scalars().all() == ["next"]


async def test_a_reader_sees_one_instant_and_lets_a_writer_through(engine) -> None:
    count = select(func.count()).select_from(_KINDS)
    async with sqlite_core.reading(engine) as reader:
        assert (await reader.execute(count)).scalar_one() == 0
        # A writer commits while the reader is open: WAL lets it through.
        async with asyncio.timeout(10):
            async with fast(engine) as writer:
                await writer.execute(insert(_KINDS), _row("during"))
        assert (await reader.execute(count)).scalar_one() == 0
    async with sqlite_core.reading(engine) as reader:
        assert (await reader.execute(count)).scalar_one() == 1


async def _warm(engine: AsyncEngine) -> None:
    """The pool's connection opened and known idle."""
    async with fast(engine) as conn:
        await conn.execute(select(_KINDS.c.id))


async def _warm_and_listen(engine: AsyncEngine) -> list[str]:
    """The pool warmed; what the listeners are told from now: each statement
    (its first six characters) once sent, and each commit before it is."""
    await _warm(engine)
    told: list[str] = []
    event.listen(engine.sync_engine, "after_cursor_execute", lambda *a: told.append(a[2][:6]))
    event.listen(engine.sync_engine, "commit", lambda *_: told.append("COMMIT"))
    return told


async def test_writes_left_for_later_go_with_the_next_statement_or_before_the_commit(
    engine, trips
) -> None:
    told = await _warm_and_listen(engine)
    trips.clear()
    async with fast(engine) as conn:
        conn.later(insert(_KINDS), _row("a") | {"name": "a"})
        conn.later(update(_KINDS).where(_KINDS.c.id == "a").values(small=1))
        seen = (await conn.execute(select(_KINDS.c.small).where(_KINDS.c.id == "a"))).scalar()
        assert seen == 1  # the writes went first, in this statement's trip
        conn.later(insert(_KINDS), _row("b"))
        conn.later(insert(_KINDS), _row("c") | {"name": "c"})
    # BEGIN with the two writes and the read; the last two writes; the commit.
    assert len(trips) == 3
    assert told == ["BEGIN ", "INSERT", "UPDATE", "SELECT", "INSERT", "INSERT", "COMMIT"]
    async with engine.connect() as conn:
        assert (await conn.execute(select(_KINDS.c.id).order_by(_KINDS.c.id))).scalars().all() == [
            "a",
            "b",
            "c",
        ]


async def test_a_last_statement_goes_with_the_commit_in_one_trip(engine, trips) -> None:
    """execute_and_commit: the BEGIN, the writes left for later, the statement
    and the commit in one trip; its result read; nothing goes after it; the
    commit's listeners told before the commit is sent, once."""
    told = await _warm_and_listen(engine)
    trips.clear()
    async with fast(engine) as conn:
        conn.later(insert(_KINDS), _row("a") | {"name": "a"})
        returned = await conn.execute_and_commit(
            insert(_KINDS).returning(_KINDS.c.id), _row("b") | {"name": "b"}
        )
        assert returned.scalar_one() == "b"
        with pytest.raises(RuntimeError, match="has committed"):
            await conn.execute(select(_KINDS.c.id))
        with pytest.raises(RuntimeError, match="has committed"):
            conn.later(insert(_KINDS), _row("c"))
    assert trips == ["_steps"]  # no commit's trip, no rollback: the pool's is not sent either
    assert told == ["BEGIN ", "COMMIT", "INSERT", "INSERT"]
    async with sqlite_core.reading(engine, alone=True) as conn:
        assert (await conn.execute(select(_KINDS.c.id).order_by(_KINDS.c.id))).scalars().all() == [
            "a",
            "b",
        ]


async def test_a_last_statement_that_fails_commits_nothing(engine) -> None:
    """The statement fails: the writes before it and the commit are not
    made, the block rolls back, and the connection serves the next one. An
    error raised in the block after the commit leaves the commit standing."""
    async with fast(engine) as conn:
        await conn.execute(insert(_KINDS), _row("taken"))
    with pytest.raises(exc.IntegrityError) as failed:
        async with fast(engine) as conn:
            conn.later(insert(_KINDS), _row("fresh") | {"name": "fresh"})
            await conn.execute_and_commit(insert(_KINDS), _row("taken"))
    assert "INSERT" in str(failed.value)

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        async with fast(engine) as conn:
            await conn.execute_and_commit(insert(_KINDS), _row("kept") | {"name": "kept"})
            raise Boom
    async with asyncio.timeout(10), fast(engine) as conn:
        ids = (await conn.execute(select(_KINDS.c.id).order_by(_KINDS.c.id))).scalars().all()
    assert ids == ["kept", "taken"]


async def test_an_after_listener_raising_cannot_undo_a_last_statements_commit(engine) -> None:
    """Found in review: the after-listeners hear of the statement once it is
    committed. One that raises is the caller's error, the row stays, and no
    rollback is told for a transaction that committed (as documented: the
    write must be safe to find made after an error)."""
    heard: list[str] = []

    def raising(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.startswith("INSERT"):
            raise RuntimeError("a listener's own failure")

    event.listen(engine.sync_engine, "commit", lambda *_: heard.append("commit"))
    event.listen(engine.sync_engine, "rollback", lambda *_: heard.append("rollback"))
    event.listen(engine.sync_engine, "after_cursor_execute", raising)
    with pytest.raises(RuntimeError, match="own failure"):
        async with fast(engine) as conn:
            await conn.execute_and_commit(insert(_KINDS), _row("made") | {"name": "made"})
    event.remove(engine.sync_engine, "after_cursor_execute", raising)
    assert heard == ["commit"]
    async with sqlite_core.reading(engine, alone=True) as conn:
        assert (await conn.execute(select(_KINDS.c.id))).scalars().all() == ["made"]


async def test_a_commit_that_fails_in_the_trip_is_the_commits_error(engine) -> None:
    """A deferred foreign key is checked at the commit: the commit fails in
    the statement's trip, is reported as the commit's, and nothing stays."""
    async with engine.begin() as conn:
        await conn.exec_driver_sql("CREATE TABLE parent (id TEXT PRIMARY KEY)")
        await conn.exec_driver_sql(
            "CREATE TABLE child (id TEXT PRIMARY KEY, parent TEXT "
            "REFERENCES parent(id) DEFERRABLE INITIALLY DEFERRED)"
        )
    child = text("INSERT INTO child (id, parent) VALUES (:id, 'nobody') RETURNING id")
    with pytest.raises(exc.IntegrityError) as failed:
        async with fast(engine) as conn:
            await conn.execute_and_commit(child, {"id": "orphan"})
    assert "COMMIT" in str(failed.value)
    async with fast(engine) as conn:
        assert (await conn.execute(text("SELECT count(*) FROM child"))).scalar_one() == 0


async def test_a_write_left_for_later_fails_where_it_is_sent_and_nothing_stays(engine) -> None:
    async with fast(engine) as conn:
        conn.later(insert(_KINDS), _row("taken"))
    with pytest.raises(exc.IntegrityError) as failed:
        async with fast(engine) as conn:
            conn.later(insert(_KINDS), _row("fresh") | {"name": "fresh"})
            conn.later(insert(_KINDS), _row("taken"))  # the same key
            await conn.execute(select(_KINDS.c.id))
    assert "INSERT" in str(failed.value) and "hidden" in str(failed.value)
    with pytest.raises(exc.IntegrityError):
        async with fast(engine) as conn:
            conn.later(insert(_KINDS), _row("taken"))  # fails in the trip before the commit
    # Unstorable text is refused when the write is left, before anything is sent.
    with pytest.raises(InvalidInputError):
        async with fast(engine) as conn:
            conn.later(insert(_KINDS), _row("nul", body="\x00"))
            raise AssertionError("not reached")
    async with engine.connect() as conn:
        assert (await conn.execute(select(_KINDS.c.id))).scalars().all() == ["taken"]


async def test_writes_left_for_later_are_dropped_by_a_rollback_or_a_cancel(engine) -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        async with fast(engine) as conn:
            conn.later(insert(_KINDS), _row("dropped"))
            raise Boom

    async def write(conn: Any) -> None:
        conn.later(insert(_KINDS), _row("cancelled"))

    await cancelled_inside(lambda: fast(engine), write)
    async with engine.connect() as conn:
        assert (await conn.execute(select(_KINDS.c.id))).all() == []


async def test_a_lone_read_is_one_trip_outside_any_transaction(engine, trips) -> None:
    await _warm(engine)
    trips.clear()
    async with sqlite_core.reading(engine, alone=True) as conn:
        assert (await conn.execute(select(func.count()).select_from(_KINDS))).scalar_one() == 0
        with pytest.raises(RuntimeError, match="one statement"):
            await conn.execute(select(_KINDS.c.id))
    # One trip: no BEGIN, no rollback (the pool's is not sent either).
    assert trips == ["_steps"]
    # Nothing held: a writer goes through at once, and the next lone read sees it.
    async with asyncio.timeout(10), fast(engine) as conn:
        await conn.execute(insert(_KINDS), _row("after"))
    async with sqlite_core.reading(engine, alone=True) as conn:
        assert (await conn.execute(select(_KINDS.c.id))).scalars().all() == ["after"]


# What an adversarial review found the fast path did unlike SQLAlchemy, none
# of it reached by the store's own calls, each now as SQLAlchemy does it.


async def test_listeners_may_change_what_is_sent_and_hear_the_row_count(engine) -> None:
    heard: list[tuple[str, int]] = []

    def tag(_conn, _cursor, statement, parameters, _context, _many):  # type: ignore[no-untyped-def]
        return statement + " -- tagged", parameters

    def count(_conn, cursor, statement, *_):  # type: ignore[no-untyped-def]
        heard.append((statement, cursor.rowcount))

    event.listen(engine.sync_engine, "before_cursor_execute", tag, retval=True)
    event.listen(engine.sync_engine, "after_cursor_execute", count)
    async with fast(engine) as conn:
        await conn.execute(insert(_KINDS), _row("a"))
        conn.later(update(_KINDS).values(small=2))
    assert [(sql.endswith("-- tagged"), n) for sql, n in heard[-2:]] == [(True, 1), (True, 1)]


async def test_a_reader_refuses_a_write_left_for_later(engine) -> None:
    for alone in (False, True):
        async with sqlite_core.reading(engine, alone=alone) as conn:
            with pytest.raises(RuntimeError, match="does not write"):
                conn.later(insert(_KINDS), _row("never"))
    async with engine.connect() as conn:
        assert (await conn.execute(select(_KINDS.c.id))).all() == []


async def test_statements_built_per_call_do_not_pile_up_in_the_compiled_memo(engine) -> None:
    class Opaque(ColumnClause):  # a construct SQLAlchemy cannot cache
        inherit_cache = False

    @compiles(Opaque)
    def _opaque(element, compiler, **kw):  # type: ignore[no-untyped-def]
        return "id"

    for n in range(core_statements._COMPILED_KEPT + 300):
        built = (
            select(Opaque("id")).select_from(_KINDS)
            if n % 2
            else select(_KINDS.c.id).where(_KINDS.c.small == n)
        )
        async with sqlite_core.reading(engine, alone=True) as conn:
            await conn.execute(built)
    assert len(core_statements._COMPILED) <= core_statements._COMPILED_KEPT


async def test_a_lone_reader_or_a_write_left_for_later_kept_past_the_block_is_refused(
    engine,
) -> None:
    async with sqlite_core.reading(engine, alone=True) as lone:
        pass
    with pytest.raises(exc.ResourceClosedError):
        await lone.execute(select(_KINDS.c.id))
    async with fast(engine) as kept:
        pass
    with pytest.raises(exc.ResourceClosedError):
        kept.later(insert(_KINDS), _row("late"))
