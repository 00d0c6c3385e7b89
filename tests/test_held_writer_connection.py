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
import functools
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, text

from roundtable.store import Store, open_store
from roundtable.store import engine as engine_module


class Boom(Exception):
    pass


@pytest.fixture
async def sqlite_file_store(tmp_path: Path) -> AsyncIterator[Store]:
    async with open_store(f"sqlite+aiosqlite:///{tmp_path / 'held.db'}") as store:
        raw = sqlite3.connect(store.engine.url.database, isolation_level=None)
        raw.execute("CREATE TABLE t (v TEXT)")
        raw.close()
        yield store


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
    inside = asyncio.Event()

    async def stalled() -> None:
        async with store.db.core_transaction() as (connection, _notes):
            await connection.execute(text("INSERT INTO t (v) VALUES ('cancelled')"))
            inside.set()
            await asyncio.sleep(60)

    task = asyncio.ensure_future(stalled())
    await inside.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
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
    real = driver.rollback

    async def failing() -> None:
        driver.rollback = real  # once
        raise sqlite3.OperationalError("injected: the rollback failed")

    driver.rollback = failing
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
    real = driver.commit

    async def skipped() -> None:
        driver.commit = real  # once

    driver.commit = skipped
    await write(store, "never committed")
    assert held_driver(store) is None  # not known idle: given back
    assert committed(store) == ["before"] and lock_free(store)
    await write(store, "after")
    assert committed(store) == ["before", "after"]


async def test_closing_the_store_gives_the_held_connection_back(tmp_path: Path) -> None:
    async with open_store(f"sqlite+aiosqlite:///{tmp_path / 'closed.db'}") as store:
        raw = sqlite3.connect(store.engine.url.database, isolation_level=None)
        raw.execute("CREATE TABLE t (v TEXT)")
        raw.close()
        await write(store, "one")
        driver = held_driver(store)
        assert driver is not None and store.engine.pool.checkedout() == 1
    # Back in the pool, and the pool disposed of: its thread has ended.
    assert store.db.writer_connection is not None
    assert store.db.writer_connection.driver is None
    driver._thread.join(timeout=10)
    assert not driver._thread.is_alive()


async def test_closing_waits_for_the_writer_using_the_connection(sqlite_file_store: Store) -> None:
    store = sqlite_file_store
    inside, go_on = asyncio.Event(), asyncio.Event()

    async def slow() -> None:
        async with store.db.core_transaction() as (connection, _notes):
            await connection.execute(text("INSERT INTO t (v) VALUES ('slow')"))
            inside.set()
            await go_on.wait()

    writer = asyncio.ensure_future(slow())
    await inside.wait()
    closing = asyncio.ensure_future(store.db.close())
    await asyncio.sleep(0.05)
    assert not closing.done()  # not while the writer holds it
    go_on.set()
    await writer
    await closing
    assert committed(store) == ["slow"]
    assert held_driver(store) is None and store.engine.pool.checkedout() == 0


async def test_nothing_is_held_from_a_pool_of_one(tmp_path: Path, monkeypatch) -> None:
    """A held connection would leave such a pool nothing to lend a reader."""
    monkeypatch.setattr(
        engine_module,
        "create_async_engine",
        functools.partial(engine_module.create_async_engine, pool_size=1, max_overflow=0),
    )
    async with open_store(f"sqlite+aiosqlite:///{tmp_path / 'one.db'}") as store:
        raw = sqlite3.connect(store.engine.url.database, isolation_level=None)
        raw.execute("CREATE TABLE t (v TEXT)")
        raw.close()
        await write(store, "one")
        assert held_driver(store) is None and store.engine.pool.checkedout() == 0
        await asyncio.wait_for(write(store, "two"), 10)
        assert committed(store) == ["one", "two"]


async def test_postgresql_holds_nothing(postgres_url: str) -> None:
    async with open_store(postgres_url) as store:
        assert store.db.writer_connection is None
