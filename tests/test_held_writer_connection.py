"""The SQLite writers' held connection (sqlite_core.HeldConnection): the
store's Core writers, one at a time under its writer lock, keep one pooled
connection between them instead of taking one from the pool and giving it
back each time. What must hold: every writer's work is its own transaction,
committed or absent; the connection is lent again only if its last block
left it idle outside a transaction, else it goes back to the pool, which
rolls it back; closing the store gives it back; and it is never held where
the pool could then lend nobody else one."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, text

from roundtable.store import Store, open_store
from roundtable.store import engine as engine_module
from roundtable.store.engine import create_engine_for
from tests.test_core_statements import cancelled_inside


class Boom(Exception):
    pass


@pytest.fixture
async def sqlite_file_store(tmp_path: Path) -> AsyncIterator[Store]:
    async with open_store(f"sqlite+aiosqlite:///{tmp_path / 'held.db'}") as store:
        make_table(store)
        yield store


def make_table(store: Store) -> None:
    raw = sqlite3.connect(store.engine.url.database, isolation_level=None)
    raw.execute("CREATE TABLE t (v TEXT)")
    raw.close()


def checkouts(store: Store) -> list[int]:
    """How many times the pool has lent a connection, from now on."""
    counted = [0]

    def lent(*_args: Any) -> None:
        counted[0] += 1

    event.listen(store.engine.sync_engine, "checkout", lent)
    return counted


def committed(store: Store) -> list[str]:
    """What another process sees committed."""
    raw = sqlite3.connect(store.engine.url.database, isolation_level=None)
    try:
        return [v for (v,) in raw.execute("SELECT v FROM t ORDER BY rowid")]
    finally:
        raw.close()


def lock_free(store: Store) -> bool:
    """Another process can take the write lock at once: nothing of ours holds it."""
    raw = sqlite3.connect(store.engine.url.database, isolation_level=None, timeout=0)
    try:
        raw.execute("BEGIN IMMEDIATE")
        raw.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        raw.close()


async def write(store: Store, value: str, fail: bool = False) -> None:
    async with store.db.core_transaction() as (connection, _notes):
        await connection.execute(text("INSERT INTO t (v) VALUES (:v)"), {"v": value})
        if fail:
            raise Boom


def once(driver: Any, name: str, instead: Callable[[], Awaitable[None]]) -> None:
    """The driver's ``name`` replaced by ``instead`` for its next call."""
    real = getattr(driver, name)

    async def replaced() -> None:
        setattr(driver, name, real)
        await instead()

    setattr(driver, name, replaced)


def held_driver(store: Store) -> Any:
    held = store.db.writer_connection
    assert held is not None
    return held.driver


async def test_writers_one_after_another_take_one_connection_from_the_pool(
    sqlite_file_store: Store,
) -> None:
    store = sqlite_file_store
    lent = checkouts(store)
    for index in range(10):
        await write(store, f"w{index}")
        # Each committed before the next began, and left nothing open.
        assert committed(store)[-1] == f"w{index}" and lock_free(store)
    assert lent[0] <= 1  # none at all if one was held already
    driver = held_driver(store)
    assert driver is not None and driver.known_idle and not driver._conn.in_transaction


async def test_concurrent_writers_queue_on_the_held_connection(sqlite_file_store: Store) -> None:
    store = sqlite_file_store
    await asyncio.gather(
        *(write(store, f"c{index}", fail=index % 3 == 0) for index in range(30)),
        return_exceptions=True,
    )
    assert sorted(committed(store)) == sorted(f"c{index}" for index in range(30) if index % 3)
    assert lock_free(store)


async def test_a_writer_that_raises_keeps_nothing_and_the_connection_is_lent_again(
    sqlite_file_store: Store,
) -> None:
    store = sqlite_file_store
    await write(store, "before")
    driver = held_driver(store)
    with pytest.raises(Boom):
        await write(store, "lost", fail=True)
    assert committed(store) == ["before"] and lock_free(store)
    # Rolled back, so known idle: the same connection serves the next writer.
    assert held_driver(store) is driver and driver.known_idle
    await write(store, "after")
    assert committed(store) == ["before", "after"]


async def test_a_writer_cancelled_inside_its_block_keeps_nothing(sqlite_file_store: Store) -> None:
    store = sqlite_file_store

    @contextlib.asynccontextmanager
    async def writing() -> AsyncIterator[Any]:
        async with store.db.core_transaction() as (connection, _notes):
            yield connection

    async def insert(connection: Any) -> None:
        await connection.execute(text("INSERT INTO t (v) VALUES ('cancelled')"))

    await cancelled_inside(writing, insert)
    assert committed(store) == [] and lock_free(store)
    await write(store, "next")
    assert committed(store) == ["next"]


async def test_a_rollback_that_fails_sends_the_connection_back_to_the_pool(
    sqlite_file_store: Store,
) -> None:
    """Attack: the writer's block raises and its rollback fails too, leaving
    the transaction open on the held connection. It must not be lent to the
    next writer (whose statements would join the open transaction): the
    pool's reset rolls it back, and the next writer takes a fresh one."""
    store = sqlite_file_store
    await write(store, "before")
    driver = held_driver(store)

    async def failing() -> None:
        raise sqlite3.OperationalError("injected: the rollback failed")

    once(driver, "rollback", failing)
    with pytest.raises(Exception, match="rollback failed"):
        await write(store, "lost", fail=True)
    assert held_driver(store) is None  # given back, not kept
    assert store.engine.pool.checkedout() == 0
    assert committed(store) == ["before"] and lock_free(store)
    await write(store, "after")
    assert committed(store) == ["before", "after"] and lock_free(store)
    fresh = held_driver(store)
    assert fresh is not None and fresh.known_idle


async def test_a_connection_left_inside_a_transaction_is_not_lent_again(
    sqlite_file_store: Store,
) -> None:
    """Attack: a block that commits nothing it began (its commit is
    skipped, as if the connection were left mid-transaction some other
    way) must not hand that transaction to the next writer."""
    store = sqlite_file_store
    await write(store, "before")
    driver = held_driver(store)

    async def skipped() -> None:
        pass

    once(driver, "commit", skipped)
    await write(store, "never committed")
    assert held_driver(store) is None  # not known idle: given back
    assert committed(store) == ["before"] and lock_free(store)
    await write(store, "after")
    assert committed(store) == ["before", "after"]


async def test_closing_the_store_gives_the_held_connection_back(tmp_path: Path) -> None:
    async with open_store(f"sqlite+aiosqlite:///{tmp_path / 'closed.db'}") as store:
        make_table(store)
        await write(store, "one")
        driver = held_driver(store)
        assert driver is not None and store.engine.pool.checkedout() == 1
    # Back in the pool, and the pool disposed of: its thread has ended.
    assert store.db.writer_connection is not None
    assert store.db.writer_connection.driver is None
    driver._thread.join(timeout=10)
    assert not driver._thread.is_alive()


async def test_closing_under_a_writer_lets_it_finish_then_gives_the_connection_back(
    sqlite_file_store: Store,
) -> None:
    """Closing does not wait for the writer using the connection (a
    shutdown must not wait on every writer queued): that writer commits,
    and gives the connection back at its end."""
    store = sqlite_file_store
    inside, go_on = asyncio.Event(), asyncio.Event()

    async def slow() -> None:
        async with store.db.core_transaction() as (connection, _notes):
            await connection.execute(text("INSERT INTO t (v) VALUES ('slow')"))
            inside.set()
            await go_on.wait()

    writer = asyncio.ensure_future(slow())
    await inside.wait()
    try:
        await asyncio.wait_for(store.db.close(), 5)
        assert held_driver(store) is not None  # still the writer's
    finally:
        go_on.set()
        await writer
    assert committed(store) == ["slow"]
    assert held_driver(store) is None and store.engine.pool.checkedout() == 0


async def test_a_writer_after_the_store_closed_holds_nothing(tmp_path: Path) -> None:
    """A late writer (an activity still finishing as the worker stops)
    takes its connection from the pool and gives it back, as before."""
    async with open_store(f"sqlite+aiosqlite:///{tmp_path / 'late.db'}") as store:
        make_table(store)
        await write(store, "one")
    await write(store, "two")
    assert held_driver(store) is None and store.engine.pool.checkedout() == 0
    assert committed(store) == ["one", "two"]
    await store.engine.dispose()


async def test_a_close_cancelled_while_a_writer_runs_still_gets_the_connection_back(
    tmp_path: Path,
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'cancelled.db'}"
    inside, go_on = asyncio.Event(), asyncio.Event()
    opened: list[Store] = []
    writers: list[asyncio.Future[None]] = []

    async def serving() -> None:
        async with open_store(url) as store:
            opened.append(store)
            make_table(store)

            async def slow() -> None:
                async with store.db.core_transaction() as (connection, _notes):
                    await connection.execute(text("INSERT INTO t (v) VALUES ('slow')"))
                    inside.set()
                    await go_on.wait()

            writers.append(asyncio.ensure_future(slow()))
            await inside.wait()

    task = asyncio.ensure_future(serving())
    await inside.wait()
    for _ in range(5):
        await asyncio.sleep(0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    go_on.set()
    await writers[0]
    assert held_driver(opened[0]) is None


async def test_a_store_kept_across_its_engines_dispose_holds_a_fresh_connection(
    tmp_path: Path,
) -> None:
    """The engine disposed of under a store built without open_store: the
    held connection, which the new pool would never close, is closed, and
    the next writer holds one of the new pool's."""
    engine = create_engine_for(f"sqlite+aiosqlite:///{tmp_path / 'direct.db'}")
    store = Store(engine)
    make_table(store)
    await write(store, "one")
    old = held_driver(store)
    await engine.dispose()
    await write(store, "two")
    assert committed(store) == ["one", "two"]
    old._thread.join(timeout=10)
    assert not old._thread.is_alive()
    assert held_driver(store) is not old
    await store.close()
    await engine.dispose()
    assert engine.pool.checkedout() == 0


@pytest.mark.parametrize("cancels", [1, 4, 10])
def test_a_writer_cancelled_again_and_again_lets_the_process_exit(
    tmp_path: Path, cancels: int
) -> None:
    """Attack (the review's): another process holds the write lock, so the
    writer's first statement waits on SQLite's thread; the writer is
    cancelled again and again. Its connection goes back to the pool, and
    the process must still exit: a close cut half-way (the fourth
    cancellation, before taking and giving back ran to their end) left a
    task that ``asyncio.run`` waited on forever."""
    script = textwrap.dedent(
        """
        import asyncio, contextlib, sqlite3, sys
        from sqlalchemy import text
        from roundtable.store import open_store

        PATH, CANCELS = sys.argv[1], int(sys.argv[2])

        async def main():
            async with open_store("sqlite+aiosqlite:///" + PATH) as store:
                raw = sqlite3.connect(PATH, isolation_level=None)
                raw.execute("CREATE TABLE t (v TEXT)")
                raw.close()

                async def write(value):
                    async with store.db.core_transaction() as (connection, _):
                        await connection.execute(
                            text("INSERT INTO t (v) VALUES (:v)"), {"v": value}
                        )

                await write("warm")
                other = sqlite3.connect(PATH, isolation_level=None)
                other.execute("BEGIN IMMEDIATE")
                other.execute("INSERT INTO t VALUES ('other')")
                victim = asyncio.ensure_future(write("victim"))
                await asyncio.sleep(0.1)
                for _ in range(CANCELS):
                    victim.cancel()
                    await asyncio.sleep(0)
                await asyncio.sleep(0.05)
                other.execute("COMMIT")
                other.close()
                with contextlib.suppress(asyncio.CancelledError):
                    await victim
                await write("next")
            rows = [v for (v,) in sqlite3.connect(PATH).execute("SELECT v FROM t ORDER BY rowid")]
            print("rows", rows, flush=True)

        asyncio.run(main())
        print("exited", flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "exit.db"), str(cancels)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rows ['warm', 'other', 'next']" in done.stdout and "exited" in done.stdout


def pools_of(monkeypatch: pytest.MonkeyPatch, size: int, **options: Any) -> None:
    """Every engine made from now on (in this test) pools ``size``
    connections, and never more (``options``: more of the pool's)."""
    monkeypatch.setattr(
        engine_module,
        "create_async_engine",
        functools.partial(
            engine_module.create_async_engine, pool_size=size, max_overflow=0, **options
        ),
    )


async def test_nothing_is_held_from_a_pool_of_one(tmp_path: Path, monkeypatch) -> None:
    """A held connection would leave such a pool nothing to lend a reader."""
    pools_of(monkeypatch, 1)
    async with open_store(f"sqlite+aiosqlite:///{tmp_path / 'one.db'}") as store:
        make_table(store)
        await write(store, "one")
        assert held_driver(store) is None and store.engine.pool.checkedout() == 0
        await asyncio.wait_for(write(store, "two"), 10)
        assert committed(store) == ["one", "two"]


async def test_postgresql_holds_nothing(postgres_url: str) -> None:
    async with open_store(postgres_url) as store:
        assert store.db.writer_connection is None
