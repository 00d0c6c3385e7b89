"""SQLite's readers' kept connections (sqlite_readers.HeldReaders): lone
reads and reading transactions keep a few idle connections out of the pool
between them instead of taking one and giving it back each time. What must
hold: a read on a kept connection sees every commit made before it (nothing
kept holds a snapshot, the write lock or a checkpoint back); a connection is
kept only if its block left it idle outside a transaction, else it goes back
to the pool, which rolls it back; concurrent reads never share one; never
more are kept than the pool can spare; a connection taken for a caller
cancelled meanwhile is not lost; closing the store, or disposing of its
engine, gives them back."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sqlite3
import subprocess
import sys
import textwrap
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, text

from roundtable.store import Store, open_store
from roundtable.store.engine import create_engine_for
from roundtable.store.sqlite_driver import OneTripConnection
from roundtable.store.sqlite_readers import READERS_KEPT
from tests.test_core_claim_attacks import assert_pool_clean
from tests.test_held_writer_connection import checkouts, lock_free, make_table, pools_of, write

# Long enough to cancel a read while SQLite's thread runs it.
SLOW_COUNT = (
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 3000000) "
    "SELECT count(*) FROM c"
)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    async with open_store(f"sqlite+aiosqlite:///{tmp_path / 'readers.db'}") as made:
        make_table(made)
        yield made


def kept(store: Store) -> list[OneTripConnection]:
    readers = store.db.reader_connections
    assert readers is not None
    return readers.drivers


def commit_elsewhere(store: Store, value: str) -> None:
    """Another process's committed write."""
    raw = sqlite3.connect(store.engine.url.database, isolation_level=None)
    try:
        raw.execute("INSERT INTO t (v) VALUES (?)", (value,))
    finally:
        raw.close()


async def lone_read(store: Store) -> list[str]:
    async with store.db.core_reader(alone=True) as connection:
        return [v for (v,) in (await connection.execute(text("SELECT v FROM t ORDER BY rowid")))]


async def read_in_a_transaction(store: Store, meanwhile: Any = None) -> list[str]:
    async with store.db.core_reader() as connection:
        first = [v for (v,) in await connection.execute(text("SELECT v FROM t ORDER BY rowid"))]
        if meanwhile is not None:
            await meanwhile()
        second = [v for (v,) in await connection.execute(text("SELECT v FROM t ORDER BY rowid"))]
        assert first == second  # one instant for the whole block
        return first


async def test_reads_one_after_another_take_one_connection_from_the_pool(store: Store) -> None:
    lent = checkouts(store)
    for index in range(10):
        commit_elsewhere(store, f"v{index}")
        # Each read sees the commit made just before it, on the kept connection.
        read = lone_read if index % 2 else read_in_a_transaction
        assert (await read(store))[-1] == f"v{index}"
    assert lent[0] == 1
    assert len(kept(store)) == 1
    assert_pool_clean(store)


async def test_a_kept_reader_holds_back_no_writer_and_no_checkpoint(store: Store) -> None:
    """Nothing kept is inside a transaction: another process takes the write
    lock, and a checkpoint truncates the whole log, while readers are kept."""
    for index in range(5):
        commit_elsewhere(store, f"v{index}")
        await read_in_a_transaction(store)
    assert kept(store) and lock_free(store)
    raw = sqlite3.connect(store.engine.url.database, isolation_level=None)
    try:
        busy, _log, _done = raw.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    finally:
        raw.close()
    assert busy == 0
    assert await lone_read(store) == [f"v{index}" for index in range(5)]


async def test_a_kept_reader_reads_while_another_process_writes(store: Store) -> None:
    await lone_read(store)
    other = sqlite3.connect(store.engine.url.database, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute("INSERT INTO t (v) VALUES ('uncommitted')")
        assert await asyncio.wait_for(lone_read(store), 10) == []
        other.execute("COMMIT")
    finally:
        other.close()
    assert await lone_read(store) == ["uncommitted"]


async def test_concurrent_reads_never_share_a_connection_and_few_are_kept(store: Store) -> None:
    commit_elsewhere(store, "one")
    inside: list[OneTripConnection] = []
    all_in, go_on = asyncio.Event(), asyncio.Event()
    readers = 8

    async def overlapping() -> list[str]:
        async with store.db.core_reader() as connection:
            rows = [v for (v,) in await connection.execute(text("SELECT v FROM t"))]
            inside.append(connection._driver)
            if len(inside) == readers:
                all_in.set()
            await go_on.wait()
            return rows

    reads = [asyncio.ensure_future(overlapping()) for _ in range(readers)]
    await asyncio.wait_for(all_in.wait(), 10)
    assert len({id(driver) for driver in inside}) == readers
    go_on.set()
    assert await asyncio.gather(*reads) == [["one"]] * readers
    assert len(kept(store)) == READERS_KEPT
    assert_pool_clean(store)


async def test_a_reader_that_raises_keeps_its_connection_only_if_idle(store: Store) -> None:
    commit_elsewhere(store, "one")
    with pytest.raises(ZeroDivisionError):
        async with store.db.core_reader() as connection:
            await connection.execute(text("SELECT v FROM t"))
            raise ZeroDivisionError
    # Rolled back: idle outside a transaction, so kept and lent again.
    (driver,) = kept(store)
    assert await lone_read(store) == ["one"]
    assert kept(store) == [driver]
    assert_pool_clean(store)


async def test_a_reader_whose_rollback_fails_goes_back_to_the_pool(store: Store) -> None:
    """Attack: the reading transaction's rollback fails, leaving it open on
    the connection. It must not be kept (the next read would see the old
    instant, and hold the log's checkpoint back): the pool's reset rolls it
    back."""
    await read_in_a_transaction(store)
    (driver,) = kept(store)
    real = driver.rollback

    async def failing() -> None:
        driver.rollback = real  # once
        raise sqlite3.OperationalError("injected: the rollback failed")

    driver.rollback = failing
    with pytest.raises(Exception, match="rollback failed"):
        await read_in_a_transaction(store)
    assert driver not in kept(store)
    assert_pool_clean(store)
    assert not driver._conn.in_transaction  # the pool rolled it back
    commit_elsewhere(store, "after")
    assert await read_in_a_transaction(store) == ["after"]


async def cancelled_on_the_thread(store: Store, alone: bool) -> None:
    """A read of ``SLOW_COUNT`` cut off while SQLite's thread runs it."""
    started = asyncio.Event()

    async def slow() -> None:
        async with store.db.core_reader(alone=alone) as connection:
            started.set()
            await connection.execute(text(SLOW_COUNT))

    task = asyncio.ensure_future(slow())
    await started.wait()
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_lone_read_cancelled_while_the_thread_runs_it_is_not_kept(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone read cut off while SQLite's thread runs it leaves the
    connection's state unknown: it goes back to the pool (whose reset waits
    for the thread), and the next read takes another."""
    await lone_read(store)
    (driver,) = kept(store)
    monkeypatch.setattr(OneTripConnection, "_may_run_here", lambda *_args: False)
    await cancelled_on_the_thread(store, alone=True)
    assert driver not in kept(store)
    assert_pool_clean(store)
    monkeypatch.undo()
    commit_elsewhere(store, "after")
    assert await lone_read(store) == ["after"]
    assert_pool_clean(store)


async def test_a_reading_transaction_cancelled_on_the_thread_is_kept_once_rolled_back(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reading transaction cut off the same way rolls back at its end,
    behind the statement on the thread: then its state is known again (idle,
    outside a transaction), and it may be kept."""
    await lone_read(store)
    monkeypatch.setattr(OneTripConnection, "_may_run_here", lambda *_args: False)
    await cancelled_on_the_thread(store, alone=False)
    assert_pool_clean(store)  # whatever is kept is idle outside a transaction
    monkeypatch.undo()
    commit_elsewhere(store, "after")
    assert await read_in_a_transaction(store) == ["after"]
    assert lock_free(store)


async def test_a_caller_cancelled_while_a_connection_is_taken_loses_none(tmp_path: Path) -> None:
    """Cancelled at every step of taking a connection afresh, one SQLite must
    open (the pool has none): whatever was taken from the pool is kept or
    given back, never lost, and its thread ends with the engine's dispose."""
    engine = create_engine_for(f"sqlite+aiosqlite:///{tmp_path / 'taken.db'}")
    store = Store(engine)
    make_table(store)
    drivers: list[OneTripConnection] = []
    for steps in range(40):
        await engine.dispose()  # a new pool, with no connection yet
        task = asyncio.ensure_future(lone_read(store))
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for _ in range(50):  # the take or the give-back finishing
            await asyncio.sleep(0)
        assert_pool_clean(store)
        drivers += kept(store)
    assert await lone_read(store) == []
    await store.close()
    await engine.dispose()
    assert engine.pool.checkedout() == 0
    for driver in drivers:
        driver._thread.join(timeout=10)
        assert not driver._thread.is_alive()


async def test_closing_the_store_gives_the_kept_readers_back(tmp_path: Path) -> None:
    engine = create_engine_for(f"sqlite+aiosqlite:///{tmp_path / 'closed.db'}")
    store = Store(engine)
    make_table(store)
    await asyncio.gather(*(read_in_a_transaction(store) for _ in range(3)))
    drivers = kept(store)
    assert drivers and engine.pool.checkedout() == len(drivers)
    lent: list[Any] = []
    event.listen(engine.sync_engine, "checkin", lambda connection, _record: lent.append(connection))
    await store.close()
    # Given back to the pool (not dropped for the collector to find), before
    # its dispose, which closes only what it has.
    assert {id(d._conn) for d in drivers} <= {id(c.driver_connection._conn) for c in lent}
    assert kept(store) == [] and engine.pool.checkedout() == 0
    await engine.dispose()
    for driver in drivers:
        driver._thread.join(timeout=10)
        assert not driver._thread.is_alive()


async def test_a_kept_connection_used_behind_the_stores_back_is_not_lent(store: Store) -> None:
    """Attack: a kept connection left inside a transaction by a call the
    store did not make (its driver's own ``execute``) must not be lent: the
    next read would see that transaction's old instant. It goes back to the
    pool, which rolls it back."""
    await lone_read(store)
    (driver,) = kept(store)
    await driver.execute("BEGIN")
    pinning = await driver.execute("SELECT count(*) FROM t")  # the old instant, pinned
    await pinning.fetchall()
    await pinning.close()
    commit_elsewhere(store, "after")
    assert await lone_read(store) == ["after"]
    # The pool rolled it back (and, lending the last returned first, may
    # have lent it again as such).
    assert not driver._conn.in_transaction
    assert_pool_clean(store)


async def settled() -> None:
    """Turns of the event loop enough for what runs to its end to end."""
    for _ in range(200):
        await asyncio.sleep(0)


@pytest.mark.parametrize("steps", [0, 1, 2, 3, 5, 8])
@pytest.mark.parametrize("whose", ["the store's", "the readers' own"])
async def test_a_close_cut_half_way_still_lets_every_kept_reader_go(
    tmp_path: Path, steps: int, whose: str
) -> None:
    """Review: the store's close, cancelled after ``steps`` turns (in the
    writers' part, or while the readers' are let go one by one), left kept
    readers checked out of the pool, owned by nobody: the engine's dispose
    never closed them. The readers' own close is cut the same way."""
    engine = create_engine_for(f"sqlite+aiosqlite:///{tmp_path / 'cut.db'}")
    store = Store(engine)
    make_table(store)
    await asyncio.gather(*(read_in_a_transaction(store) for _ in range(READERS_KEPT)))
    drivers = kept(store)
    assert len(drivers) == READERS_KEPT
    readers = store.db.reader_connections
    assert readers is not None
    closing = asyncio.ensure_future(store.db.close() if whose == "the store's" else readers.close())
    for _ in range(1 + steps):  # begun, then ``steps`` turns into it
        await asyncio.sleep(0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        closing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await closing
        await settled()
        gc.collect()
    # Let go by the close, not dropped for the collector to find.
    assert [str(w.message) for w in seen if "garbage collector" in str(w.message)] == []
    assert readers.closed
    assert kept(store) == [] and engine.pool.checkedout() == 0
    await engine.dispose()
    for driver in drivers:
        driver._thread.join(timeout=10)
        assert not driver._thread.is_alive()


async def test_a_take_under_way_when_the_store_closes_keeps_nothing_after_it(
    tmp_path: Path,
) -> None:
    """Review: a read whose connection SQLite was still opening when the
    store closed, then cancelled, left that connection kept by the closed
    store for good."""
    engine = create_engine_for(f"sqlite+aiosqlite:///{tmp_path / 'late.db'}")
    make_table(Store(engine))
    for steps in range(30):
        store = Store(engine)
        await engine.dispose()  # the pool has none: SQLite opens one
        read = asyncio.ensure_future(lone_read(store))
        for _ in range(steps):
            await asyncio.sleep(0)
        await store.close()
        read.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await read
        await settled()
        assert kept(store) == [], steps
        assert engine.pool.checkedout() == 0, steps
    await engine.dispose()


async def test_reads_cancelled_while_taking_keep_no_more_than_the_pool_spares(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: every read cancelled while its connection was opened left one
    more kept (eight for eight, over a cap of three); on a pool of three,
    two left the pool nothing to lend a snapshot, which then waited out the
    pool's timeout."""
    pools_of(monkeypatch, 3, pool_timeout=3)
    async with open_store(f"sqlite+aiosqlite:///{tmp_path / 'three.db'}") as store:
        make_table(store)
        await write(store, "one")  # the writers' held connection
        for cancelled in (2, 8):
            reads = [asyncio.ensure_future(lone_read(store)) for _ in range(cancelled)]
            for _ in range(2):
                await asyncio.sleep(0)
            for read in reads:
                read.cancel()
            await asyncio.gather(*reads, return_exceptions=True)
            await settled()
            assert len(kept(store)) <= 1  # a pool of three spares one
            assert_pool_clean(store)
            async with store.db.snapshot() as session:  # not a pool timeout
                await session.execute(text("SELECT count(*) FROM t"))


@pytest.mark.parametrize("side", ["a reader", "a writer"])
async def test_a_connection_in_use_across_open_stores_exit_is_closed_at_its_end(
    tmp_path: Path, side: str
) -> None:
    """Second review: a block still running when open_store's exit closed
    the store and disposed of its engine gave the writers' connection back
    to the old pool at its end, which never closed it (its thread ran on).
    Either side's is closed now."""
    inside, go_on = asyncio.Event(), asyncio.Event()
    drivers: list[OneTripConnection] = []

    async def block(store: Store) -> None:
        if side == "a reader":
            async with store.db.core_reader() as connection:
                await connection.execute(text("SELECT 1"))
                drivers.append(connection._driver)
                inside.set()
                await go_on.wait()
            return
        async with store.db.core_transaction() as (connection, _notes):
            await connection.execute(text("INSERT INTO t (v) VALUES ('x')"))
            drivers.append(connection._driver)
            inside.set()
            await go_on.wait()

    async with open_store(f"sqlite+aiosqlite:///{tmp_path / 'exit.db'}") as store:
        make_table(store)
        await write(store, "warm")
        await lone_read(store)
        running = asyncio.ensure_future(block(store))
        await inside.wait()
    go_on.set()
    await running
    await settled()
    (driver,) = drivers
    driver._thread.join(timeout=10)
    assert not driver._thread.is_alive()


async def test_a_caller_cancelled_while_its_take_fails_sees_its_cancellation(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Second review: the take's own error (the pool's timeout) replaced the
    caller's cancellation; to_completion lets the cancellation win."""
    readers = store.db.reader_connections
    assert readers is not None
    await readers.close()
    readers.closed = False  # none kept: the next read takes one afresh
    callers: list[asyncio.Task[Any]] = []

    async def failing(_self: Any) -> None:
        callers[0].cancel()
        await asyncio.sleep(0)
        raise TimeoutError("the pool had nothing to lend")

    monkeypatch.setattr(type(readers), "_connect", failing)
    read = asyncio.ensure_future(lone_read(store))
    callers.append(read)
    with contextlib.suppress(BaseException):
        await read
    assert read.cancelled()


TEARDOWN = textwrap.dedent(
    """
    import asyncio, sqlite3, sys
    from sqlalchemy import text
    from roundtable.store import Store
    from roundtable.store.engine import create_engine_for

    PATH, STEPS, WHAT = sys.argv[1], int(sys.argv[2]), sys.argv[3]

    async def read(store):
        async with store.db.core_reader() as connection:
            return (await connection.execute(text("SELECT 1"))).all()

    async def write(store):
        async with store.db.core_transaction() as (connection, _notes):
            await connection.execute(text("INSERT INTO t (v) VALUES ('x')"))

    async def main():
        engine = create_engine_for("sqlite+aiosqlite:///" + PATH)
        store = Store(engine)
        raw = sqlite3.connect(PATH)
        raw.execute("CREATE TABLE t (v TEXT)")
        raw.commit()
        raw.close()
        await asyncio.gather(*(read(store) for _ in range(3)))
        if WHAT == "close":
            asyncio.ensure_future(store.db.close())
        elif WHAT == "take":
            await engine.dispose()  # the reads below take afresh
            for _ in range(3):
                asyncio.ensure_future(read(store))
        else:  # the writers' held connection, the same way
            await write(store)
            await engine.dispose()
            for _ in range(3):
                asyncio.ensure_future(write(store))
        for _ in range(STEPS):
            await asyncio.sleep(0)
        # main returns: asyncio.run's teardown cancels every task left

    asyncio.run(main())
    print("exited", flush=True)
    """
)


@pytest.mark.parametrize("what", ["close", "take", "write"])
def test_the_event_loops_teardown_under_a_close_or_a_take_lets_the_process_exit(
    tmp_path: Path, what: str
) -> None:
    """asyncio.run's teardown cancels every task, to_completion's own inner
    ones too, so a close under way can be cut there and leave kept readers
    unreturned (idle, outside any transaction: docs/architecture.md). What
    must hold is that the process still exits, at every step. Second
    review: with the engine disposed of under the store, a reader (or,
    before ce96c5a already, a writer) letting go of its old pool's
    connection through SQLAlchemy's termination, cut there, left a close
    waiting for a thread already stopped, and the process hung."""
    for steps in (0, 1, 2, 3, 5, 8, 13):
        done = subprocess.run(
            [sys.executable, "-c", TEARDOWN, str(tmp_path / f"{what}{steps}.db"), str(steps), what],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0 and "exited" in done.stdout, done.stderr[-3000:]


async def test_a_reader_in_use_when_the_store_closes_gives_its_connection_back(
    store: Store,
) -> None:
    inside, go_on = asyncio.Event(), asyncio.Event()

    async def reading() -> list[str]:
        async def wait() -> None:
            inside.set()
            await go_on.wait()

        return await read_in_a_transaction(store, wait)

    read = asyncio.ensure_future(reading())
    await inside.wait()
    await asyncio.wait_for(store.db.close(), 5)
    go_on.set()
    assert await read == []
    assert kept(store) == [] and store.engine.pool.checkedout() == 0
    # After the close a read takes a connection of the pool's and gives it back.
    assert await lone_read(store) == []
    assert kept(store) == [] and store.engine.pool.checkedout() == 0


async def test_a_store_kept_across_its_engines_dispose_reads_on_a_fresh_connection(
    tmp_path: Path,
) -> None:
    engine = create_engine_for(f"sqlite+aiosqlite:///{tmp_path / 'direct.db'}")
    store = Store(engine)
    make_table(store)
    await lone_read(store)
    (old,) = kept(store)
    await engine.dispose()
    commit_elsewhere(store, "after")
    assert await lone_read(store) == ["after"]
    old._thread.join(timeout=10)
    assert not old._thread.is_alive()
    assert old not in kept(store) and len(kept(store)) == 1
    await store.close()
    await engine.dispose()
    assert engine.pool.checkedout() == 0


async def test_nothing_is_kept_from_a_pool_too_small_to_spare_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pools_of(monkeypatch, 2)
    async with open_store(f"sqlite+aiosqlite:///{tmp_path / 'two.db'}") as store:
        make_table(store)
        for _ in range(3):
            await asyncio.wait_for(read_in_a_transaction(store), 10)
        assert kept(store) == []
        assert_pool_clean(store)


async def test_postgresql_keeps_no_readers(postgres_url: str) -> None:
    async with open_store(postgres_url) as store:
        assert store.db.reader_connections is None
