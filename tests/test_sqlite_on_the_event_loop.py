"""The SQLite driver runs a call on the event loop while the connection's
thread is idle (roundtable/store/sqlite_driver.py), and the event loop must
never wait for a lock there: a lock found taken (another process's writer,
here another connection on a thread of its own, which SQLite cannot tell
apart) hands what is left of the call to the thread, which waits for it as
before. Each test proves where a statement ran with a SQL function that
returns the thread it runs on."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

import roundtable.store.engine as engine_module
from roundtable.store import open_store
from tests.test_sqlite_driver_trip_attacks import driver_of, known_idle, thread_held

# A failing test waits this long for a lock, not the shipped minute.
BUSY_TIMEOUT_MS = 5_000


def which_thread(engine: AsyncEngine) -> None:
    """``SELECT thread()`` answers the thread the statement runs on."""

    @event.listens_for(engine.sync_engine, "connect")
    def _register(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.create_function("thread", 0, threading.get_ident)


@contextlib.asynccontextmanager
async def loop_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[AsyncEngine]:
    """The store's engine on a file with one table ``t``, its busy timeout
    short, ``SELECT thread()`` answering where a statement runs."""
    monkeypatch.setattr(engine_module, "SQLITE_BUSY_TIMEOUT_MS", BUSY_TIMEOUT_MS)
    made = engine_module.create_engine_for(f"sqlite+aiosqlite:///{tmp_path / 'loop.db'}")
    which_thread(made)
    try:
        async with made.begin() as conn:
            await conn.exec_driver_sql("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
        yield made
    finally:
        await made.dispose()


@pytest.fixture
async def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[AsyncEngine]:
    async with loop_engine(tmp_path, monkeypatch) as made:
        yield made


class WriteLockHolder:
    """Another writer (as another process would be): its own connection, on
    a thread of its own, holds SQLite's write lock until released, then
    writes ``row`` (if any) and commits."""

    def __init__(self, path: Path, row: str | None = None) -> None:
        self.path, self.row = path, row
        self.locked, self.release = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._hold, daemon=True)

    def _hold(self) -> None:
        other = sqlite3.connect(self.path, isolation_level=None, timeout=0)
        try:
            other.execute("BEGIN IMMEDIATE")
            self.locked.set()
            self.release.wait(30)
            if self.row is not None:
                other.execute("INSERT INTO t (v) VALUES (?)", (self.row,))
            other.execute("COMMIT")
        finally:
            other.close()

    def __enter__(self) -> WriteLockHolder:
        self.thread.start()
        assert self.locked.wait(10)
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release.set()
        self.thread.join(10)


def rows(path: Path) -> list[str]:
    reader = sqlite3.connect(path)
    try:
        return [v for (v,) in reader.execute("SELECT v FROM t ORDER BY id")]
    finally:
        reader.close()


async def pending_for_a_while(task: asyncio.Future[Any]) -> bool:
    """Whether ``task`` is still waiting after the event loop went round
    many times: it can, only if the task is not holding the event loop."""
    for _ in range(50):
        await asyncio.sleep(0.001)
    return not task.done()


async def test_a_call_runs_on_the_event_loop_while_the_thread_is_idle(engine) -> None:
    loop_thread = threading.get_ident()
    async with engine.connect() as conn:
        ran_on = (await conn.exec_driver_sql("SELECT thread()")).scalar_one()
        assert ran_on == loop_thread
        await known_idle(conn)
        raw = await driver_of(conn)
        # The thread is busy: the call queues behind it and runs there.
        with thread_held(raw):
            task = asyncio.ensure_future(conn.exec_driver_sql("SELECT thread()"))
            assert await pending_for_a_while(task)
        ran_on = (await task).scalar_one()
        assert ran_on != loop_thread
        # Idle again: back on the event loop.
        assert (await conn.exec_driver_sql("SELECT thread()")).scalar_one() == loop_thread
        await conn.commit()


@pytest.mark.parametrize("begin_held", [True, False])
async def test_a_write_waits_for_another_writers_lock_on_the_thread(
    engine, tmp_path: Path, begin_held: bool
) -> None:
    """The event loop keeps running while the write waits (the holder lets
    go only once the loop has gone round: a write waiting on the event loop
    would hold it, and fail at the busy timeout), and the write lands after
    the holder's, whole, with the statement run on the thread."""
    loop_thread = threading.get_ident()
    path = tmp_path / "loop.db"
    if not begin_held:
        # A new connection is not known idle: its BEGIN is sent alone.
        await engine.dispose()
    async with engine.connect() as conn:
        if begin_held:
            await known_idle(conn)  # the BEGIN goes with the INSERT

        async def write() -> int:
            async with conn.begin():
                await conn.exec_driver_sql("INSERT INTO t (v) VALUES ('ours')")
                return (await conn.exec_driver_sql("SELECT thread()")).scalar_one()

        with WriteLockHolder(path, row="theirs"):
            task = asyncio.ensure_future(write())
            assert await pending_for_a_while(task)
        ran_on = await task
    assert rows(path) == ["theirs", "ours"]
    # After the lock was taken on the thread, the transaction's next call
    # runs on the event loop again (the thread is idle, the lock is ours).
    assert ran_on == loop_thread


async def test_a_stores_write_waits_for_another_writers_lock_on_the_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same through the store (its Core transaction, one trip for the
    BEGIN and the first statement)."""
    monkeypatch.setattr(engine_module, "SQLITE_BUSY_TIMEOUT_MS", BUSY_TIMEOUT_MS)
    path = tmp_path / "store.db"
    async with open_store(f"sqlite+aiosqlite:///{path}") as store:
        session = await store.create_session(user_id="u", task_text="first")
        holder = sqlite3.connect(path, isolation_level=None, timeout=0)
        try:
            holder.execute("BEGIN IMMEDIATE")
            task = asyncio.ensure_future(store.create_run(session_id=session["id"], user_id="u"))
            assert await pending_for_a_while(task)
            holder.execute("COMMIT")
        finally:
            holder.close()
        run = await task
        assert (await store.get_run(run["id"]))["id"] == run["id"]


async def test_the_rest_of_a_trip_goes_to_the_thread_from_the_statement_that_met_the_lock(
    engine, tmp_path: Path
) -> None:
    """A deferred transaction's trip of two statements: the first (no
    table read, so no lock) runs on the event loop, the second (a write)
    finds the lock taken; only the second goes to the thread, which waits,
    and the answers of both come back in order."""
    loop_thread = threading.get_ident()
    path = tmp_path / "loop.db"
    async with engine.connect() as conn:
        await known_idle(conn)
        raw = await driver_of(conn)
        await raw.cursor().execute("BEGIN")  # held, goes with the trip
        steps = [
            ("execute", "SELECT thread()", ()),
            ("execute", "INSERT INTO t (v) VALUES ('ours') RETURNING thread()", ()),
        ]
        with WriteLockHolder(path):
            task = asyncio.ensure_future(raw.run_steps(steps))
            assert await pending_for_a_while(task)
        (_, first, _), (_, second, count) = await task
        await raw.commit()
    assert first == [(loop_thread,)]
    assert second[0][0] != loop_thread and count == 1
    assert rows(path) == ["ours"]


async def test_a_database_not_in_wal_mode_keeps_every_call_on_the_thread() -> None:
    """Outside WAL mode a commit waits for readers: the event loop would
    wait. The engine leaves such a connection's calls on the thread, with
    the busy timeout SQLite waits with."""
    made = engine_module.create_engine_for("sqlite+aiosqlite://")  # in memory
    which_thread(made)
    try:
        async with made.connect() as conn:
            assert (await conn.exec_driver_sql("PRAGMA journal_mode")).scalar_one() == "memory"
            ran_on = (await conn.exec_driver_sql("SELECT thread()")).scalar_one()
            assert ran_on != threading.get_ident()
            timeout = (await conn.exec_driver_sql("PRAGMA busy_timeout")).scalar_one()
            assert timeout == engine_module.SQLITE_BUSY_TIMEOUT_MS
    finally:
        await made.dispose()


async def test_on_the_event_loop_the_connection_never_waits_for_a_lock(engine) -> None:
    """Its busy timeout is 0 on the event loop; the thread sets its own for
    each call it runs, and 0 again after."""
    async with engine.connect() as conn:
        assert (await conn.exec_driver_sql("PRAGMA busy_timeout")).scalar_one() == 0
        await known_idle(conn)
        raw = await driver_of(conn)
        with thread_held(raw):
            task = asyncio.ensure_future(conn.exec_driver_sql("PRAGMA busy_timeout"))
            assert await pending_for_a_while(task)
        assert (await task).scalar_one() == BUSY_TIMEOUT_MS
        assert (await conn.exec_driver_sql("PRAGMA busy_timeout")).scalar_one() == 0
        await conn.commit()
