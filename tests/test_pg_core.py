"""Core statements on PostgreSQL's fast connection (roundtable/store/pg_core.py)
against SQLAlchemy's own execution on the same engine: the same values
stored and read, the same errors, listeners told, and a connection that is
never lent again in a state SQLAlchemy would not lend it in: inside a
transaction, mid-statement after a cancellation, or lost. What both
databases' fast connections share is held on both in
tests/test_core_statements.py."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import asyncpg
import pytest
from sqlalchemy import (
    Column,
    Integer,
    MetaData,
    Table,
    Text,
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

from roundtable.store import open_store, pg_core
from roundtable.store.database import Database
from roundtable.store.engine import create_engine_for
from roundtable.store.pg_core import PostgresCoreConnection
from tests.test_core_statements import KINDS as _KINDS
from tests.test_core_statements import META as _META
from tests.test_core_statements import cancelled_inside, store_transaction
from tests.test_core_statements import kind_row as _row


@pytest.fixture
async def engine(pg_engine: AsyncEngine) -> AsyncEngine:
    async with pg_engine.begin() as conn:
        await conn.run_sync(_META.create_all)
    return pg_engine


def fast(engine: AsyncEngine) -> Any:
    """A writing transaction on the fast connection, as the store opens one."""
    return Database(engine).core_transaction()


async def _lent_in_a_transaction(engine: AsyncEngine) -> list[bool]:
    """Whether each connection the pool lends now is inside a transaction
    (asyncpg's own view of the protocol), checked out all at once."""
    async with contextlib.AsyncExitStack() as stack:
        seen = []
        for _ in range(engine.pool.size()):
            conn = await stack.enter_async_context(engine.connect())
            raw = (await conn.get_raw_connection()).driver_connection
            seen.append(raw.is_in_transaction())
        return seen


async def test_the_store_s_transactions_and_reads_use_the_fast_connection(postgres_url) -> None:
    async with open_store(postgres_url) as store:
        async with store.db.core_transaction() as (conn, _):
            assert isinstance(conn, PostgresCoreConnection)
        async with store.db.core_reader() as conn:
            assert isinstance(conn, PostgresCoreConnection)


async def test_statements_of_every_shape_the_store_sends(engine) -> None:
    async with fast(engine) as (conn, _):
        many = await conn.execute(
            insert(_KINDS), [_row(str(n)) | {"name": f"n{n}"} for n in range(5)]
        )
        # As SQLAlchemy's: asyncpg's executemany tells no count.
        assert many.rowcount == -1
        await conn.execute(insert(_KINDS).values(**_row("built")))
        returned = await conn.execute(
            update(_KINDS)
            .where(_KINDS.c.id == bindparam("row_id"))
            .values(small=bindparam("small"))
            .returning(_KINDS.c.id, _KINDS.c.small),
            {"row_id": "built", "small": 41},
        )
        assert returned.rowcount == 1 and returned.one()._mapping["small"] == 41
        counted = await conn.execute(update(_KINDS).values(flag=False))
        assert counted.rowcount == 6
        with pytest.raises(exc.ResourceClosedError):
            counted.all()
        expanding = select(_KINDS.c.id).where(_KINDS.c.id.in_(bindparam("ids", expanding=True)))
        found = await conn.execute(expanding.order_by(_KINDS.c.id), {"ids": ["1", "3", "nope"]})
        assert found.scalars().all() == ["1", "3"]
        named = await conn.execute(text("SELECT id AS which, 2 AS two FROM kinds WHERE id = '1'"))
        assert named.keys() == ["which", "two"] and named.one() == ("1", 2)
    async with engine.connect() as conn:
        assert (await conn.execute(select(func.count()).select_from(_KINDS))).scalar_one() == 6


async def test_listeners_are_told_every_statement_the_begin_and_the_end(engine) -> None:
    told: list[tuple[str, Any]] = []
    sync = engine.sync_engine
    event.listen(sync, "begin", lambda *_: told.append(("begin", "")))
    event.listen(sync, "before_cursor_execute", lambda *a: told.append(("before", a[2])))
    event.listen(sync, "after_cursor_execute", lambda *a: told.append(("after", a[1].rowcount)))
    event.listen(sync, "commit", lambda *_: told.append(("commit", "")))
    event.listen(sync, "rollback", lambda *_: told.append(("rollback", "")))
    async with fast(engine) as (conn, _):
        await conn.execute(insert(_KINDS), _row("a"))
    assert [kind for kind, _ in told] == ["begin", "before", "after", "commit"]
    assert told[1][1].startswith("INSERT") and told[2][1] == 1
    told.clear()
    with pytest.raises(RuntimeError):
        async with fast(engine) as (conn, _):
            await conn.execute(insert(_KINDS), _row("b"))
            raise RuntimeError("the caller's own failure")
    assert [kind for kind, _ in told] == ["begin", "before", "after", "rollback"]
    async with engine.connect() as conn:
        assert (await conn.execute(select(_KINDS.c.id))).scalars().all() == ["a"]


async def test_a_failed_statement_leaves_no_connection_in_a_transaction(engine) -> None:
    async with engine.begin() as conn:
        await conn.execute(insert(_KINDS), _row("taken"))
    for _ in range(engine.pool.size() + 1):
        with pytest.raises(exc.IntegrityError) as failed:
            async with fast(engine) as (conn, _):
                await conn.execute(insert(_KINDS), _row("fresh"))
                await conn.execute(insert(_KINDS), _row("taken"))
        assert not failed.value.connection_invalidated
    assert await _lent_in_a_transaction(engine) == [False] * engine.pool.size()
    async with engine.connect() as conn:
        assert (await conn.execute(select(_KINDS.c.id))).scalars().all() == ["taken"]


async def test_a_transaction_pins_read_committed_whatever_the_engine_says(postgres_url) -> None:
    made = create_engine_for(postgres_url).execution_options(isolation_level="SERIALIZABLE")
    try:
        async with fast(made) as (conn, _):
            level = await conn.execute(text("SELECT current_setting('transaction_isolation')"))
            assert level.scalar_one() == "read committed"
        async with pg_core.reading(made) as conn:
            level = await conn.execute(text("SELECT current_setting('transaction_isolation')"))
            assert level.scalar_one() == "serializable"
    finally:
        await made.dispose()


async def test_a_statement_cancelled_mid_flight_costs_the_connection_and_keeps_nothing(
    engine,
) -> None:
    """SQLAlchemy does not lend again a connection whose statement was cut
    short (its state is unknown); nor does the fast connection."""
    started = asyncio.Event()
    pids: list[int] = []

    async def slow() -> None:
        async with fast(engine) as (conn, _):
            await conn.execute(insert(_KINDS), _row("cancelled"))
            pids.append((await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one())
            started.set()
            await conn.execute(text("SELECT pg_sleep(30)"))

    task = asyncio.create_task(slow())
    await started.wait()
    await asyncio.sleep(0.2)  # inside pg_sleep
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.pool.checkedout() == 0
    # The server was told: the cut-off statement's backend does not run on.
    assert await _gone_within(engine, pids[0], seconds=5)
    async with engine.connect() as conn:
        assert (await conn.execute(select(_KINDS.c.id))).all() == []
        assert (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one() != pids[0]
    assert await _lent_in_a_transaction(engine) == [False] * engine.pool.size()
    async with fast(engine) as (conn, _):
        await conn.execute(insert(_KINDS), _row("next"))


async def _gone_within(engine: AsyncEngine, pid: int, seconds: float) -> bool:
    """Whether the backend ``pid`` has stopped running a statement (ended,
    or idle) within ``seconds``."""
    for _ in range(int(seconds / 0.05)):
        async with engine.connect() as conn:
            state = await conn.execute(
                text("SELECT state FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}
            )
            if state.scalar_one_or_none() in (None, "idle"):
                return True
        await asyncio.sleep(0.05)
    return False


async def test_a_transaction_cut_off_in_a_lock_wait_frees_its_own_locks_at_once(
    engine, postgres_url
) -> None:
    """A claim holds the run's row and waits for another row: cancelled
    there, its backend must not wait on (for as long as the other holder
    likes) keeping the run's row locked. As on SQLAlchemy's own path, the
    server is sent the cancel."""
    async with engine.begin() as conn:
        await conn.execute(insert(_KINDS), [_row("mine"), _row("theirs", name="t")])
    holder = await asyncpg.connect(postgres_url.replace("postgresql+asyncpg", "postgresql"))
    try:
        await holder.execute("BEGIN")
        await holder.execute("UPDATE kinds SET small = 5 WHERE id = 'theirs'")
        waiting = asyncio.Event()

        async def claim_like() -> None:
            async with fast(engine) as (conn, _):
                await conn.execute(update(_KINDS).where(_KINDS.c.id == "mine").values(small=1))
                waiting.set()
                await conn.execute(update(_KINDS).where(_KINDS.c.id == "theirs").values(small=1))

        task = asyncio.create_task(claim_like())
        await waiting.wait()
        await asyncio.sleep(0.3)  # in the lock wait
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # While the other holder still holds its row, ours is free.
        async with asyncio.timeout(5):
            async with engine.begin() as conn:
                locked = select(_KINDS.c.small).where(_KINDS.c.id == "mine").with_for_update()
                assert (await conn.execute(locked)).scalar_one() == -7
    finally:
        await holder.close()


async def test_a_connection_kept_past_its_transaction_refuses_statements(engine) -> None:
    """A handle kept after its block would begin a transaction on a
    connection the pool has taken back (and then lend it, or write into
    another borrower's transaction): refused, as SQLAlchemy refuses it."""
    async with fast(engine) as (kept, _):
        await kept.execute(insert(_KINDS), _row("a"))
    assert engine.pool.checkedout() == 0
    with pytest.raises(exc.ResourceClosedError):
        await kept.execute(update(_KINDS).values(small=2))
    with pytest.raises(exc.ResourceClosedError):
        async with pg_core.reading(engine) as reader:
            pass
        await reader.execute(select(_KINDS.c.id))
    assert await _lent_in_a_transaction(engine) == [False] * engine.pool.size()
    async with engine.connect() as conn:
        assert (await conn.execute(select(_KINDS.c.small))).scalars().all() == [-7]


async def test_a_transaction_cancelled_between_statements_keeps_nothing(engine) -> None:
    async def write(conn: Any) -> None:
        await conn.execute(insert(_KINDS), _row("cancelled"))

    await cancelled_inside(lambda: store_transaction(engine), write)
    async with engine.connect() as conn:
        assert (await conn.execute(select(_KINDS.c.id))).all() == []
    assert await _lent_in_a_transaction(engine) == [False] * engine.pool.size()


async def test_a_lost_connection_is_invalidated_and_the_next_transaction_runs(
    engine, postgres_url
) -> None:
    async with fast(engine) as (conn, _):
        pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
    killer = await asyncpg.connect(postgres_url.replace("postgresql+asyncpg", "postgresql"))
    try:
        with pytest.raises(exc.DBAPIError) as lost:
            async with fast(engine) as (conn, _):
                # The pool lends the connection it has (the pre-ping passes),
                # and the backend dies under the transaction.
                assert (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one() == pid
                await killer.execute(f"SELECT pg_terminate_backend({pid})")
                await conn.execute(insert(_KINDS), _row("lost"))
        assert lost.value.connection_invalidated
    finally:
        await killer.close()
    async with fast(engine) as (conn, _):
        await conn.execute(insert(_KINDS), _row("next"))
        assert (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one() != pid
    async with engine.connect() as conn:
        assert (await conn.execute(select(_KINDS.c.id))).scalars().all() == ["next"]


async def test_a_statement_prepared_before_a_schema_change_recovers_as_sqlalchemy_does(
    engine,
) -> None:
    table = Table(
        "shifting", MetaData(), Column("id", Integer, primary_key=True), Column("v", Text)
    )
    async with engine.begin() as conn:
        await conn.run_sync(table.metadata.create_all)
        await conn.execute(insert(table), {"id": 1, "v": "x"})
    read = select(table.c.v)
    async with pg_core.reading(engine) as conn:
        assert (await conn.execute(read)).scalar_one() == "x"
    async with engine.begin() as conn:
        await conn.execute(text("ALTER TABLE shifting ALTER COLUMN v TYPE VARCHAR(10)"))
    # The cached statement's plan is stale: at most one failure, as
    # SQLAlchemy's own path has, then it is prepared afresh.
    for _attempt in range(2):
        try:
            async with pg_core.reading(engine) as conn:
                assert (await conn.execute(read)).scalar_one() == "x"
            break
        except exc.DBAPIError:
            continue
    else:
        pytest.fail("the stale prepared statement was never replaced")


async def test_a_statement_cancelled_twice_still_has_its_cancel_sent(engine) -> None:
    """The second cancellation lands while the first is being handled (the
    connection being closed): the handling still runs to its end, so the
    server is sent the statement's cancel and the backend does not run on."""
    from sqlalchemy.dialects.postgresql.asyncpg import AsyncAdapt_asyncpg_connection

    closing = asyncio.Event()
    graceful = AsyncAdapt_asyncpg_connection._terminate_graceful_close

    async def slow_close(self: Any) -> None:
        closing.set()
        await asyncio.sleep(0.05)  # as a slow network would
        await graceful(self)

    started = asyncio.Event()
    pids: list[int] = []

    async def slow() -> None:
        async with fast(engine) as (conn, _):
            pids.append((await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one())
            started.set()
            await conn.execute(text("SELECT pg_sleep(30)"))

    AsyncAdapt_asyncpg_connection._terminate_graceful_close = slow_close
    try:
        task = asyncio.create_task(slow())
        await started.wait()
        await asyncio.sleep(0.2)  # inside pg_sleep
        task.cancel()
        await asyncio.wait_for(closing.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        AsyncAdapt_asyncpg_connection._terminate_graceful_close = graceful
    assert await _gone_within(engine, pids[0], seconds=5)
    assert await _lent_in_a_transaction(engine) == [False] * engine.pool.size()


async def test_an_interrupt_mid_statement_reaches_the_caller_and_the_pool_recovers(
    engine, monkeypatch
) -> None:
    """Not a cancellation: handled where it was raised (a KeyboardInterrupt
    out of a task of its own would stop the event loop itself)."""

    async def interrupted(self: Any, sql: str, bound: Any, many: bool) -> Any:
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(PostgresCoreConnection, "_send", interrupted)
        with pytest.raises(KeyboardInterrupt):
            async with fast(engine) as (conn, _):
                await conn.execute(select(_KINDS.c.id))
    async with fast(engine) as (conn, _):
        assert (await conn.execute(select(_KINDS.c.id))).all() == []
