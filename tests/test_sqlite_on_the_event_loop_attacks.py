"""Attacks on the SQLite driver's calls on the event loop (sqlite_driver.py,
f54b62e), from its adversarial review. FINDING tests failed on f54b62e and
pass with the fix (executemany: a set of parameters sent twice, or lost,
when a lock met on the event loop handed the rest to the thread); DEFENDED
tests found nothing. (The review's coverage probes went into the attacks
they probe: tests/test_claim_fold_attacks.py, test_sqlite_driver_attacks.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.test_sqlite_driver_trip_attacks import driver_of, known_idle
from tests.test_sqlite_on_the_event_loop import (
    WriteLockHolder,
    loop_engine,
    pending_for_a_while,
    rows,
)


@pytest.fixture
async def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[AsyncEngine]:
    async with loop_engine(tmp_path, monkeypatch) as made:
        yield made


class GrabsTheLockWhenBound:
    """A parameter value that, the first time sqlite3 binds it, lets another
    writer (another process, as SQLite sees it) take the write lock, and
    releases it a little later from a thread of its own. Bound between two
    rows of an executemany in autocommit: the first row is committed, the
    second meets the lock."""

    def __init__(self, path: Path, value: str) -> None:
        self.value = value
        self.other = sqlite3.connect(path, isolation_level=None, timeout=0, check_same_thread=False)
        self.grabbed = False
        self.bound_on: list[int] = []

    def __conform__(self, protocol: Any) -> str:
        self.bound_on.append(threading.get_ident())
        if not self.grabbed:
            self.grabbed = True
            self.other.execute("BEGIN IMMEDIATE")
            threading.Timer(0.3, self._release).start()
        return self.value

    def _release(self) -> None:
        self.other.execute("COMMIT")

    def close(self) -> None:
        self.other.close()


async def test_a_lone_executemany_step_outside_a_transaction_is_not_sent_twice(
    engine, tmp_path: Path
) -> None:
    """Attack (property 1): ``run_steps`` with ONE step that is an
    executemany, outside any transaction. ``_may_run_here`` lets a one-step
    ``_steps`` call run on the event loop whatever its method (``_run`` is
    refused there for executemany, ``_steps`` is not). In autocommit each
    row commits alone; when the second row meets another writer's lock, the
    whole step (from its first row) is handed to the thread, which sends
    the first row again."""
    path = tmp_path / "loop.db"
    async with engine.connect() as conn:
        await known_idle(conn)
        raw = await driver_of(conn)
        assert not raw.in_transaction
        grab = GrabsTheLockWhenBound(path, "two")
        try:
            steps = [
                ("executemany", "INSERT INTO t (v) VALUES (?)", [("one",), (grab,), ("three",)])
            ]
            await raw.run_steps(steps)
        finally:
            grab.close()
    assert rows(path) == ["one", "two", "three"]


async def test_an_executemany_over_an_iterator_loses_no_row_when_handed_over(
    engine, tmp_path: Path
) -> None:
    """Attack (property 1, 'nothing lost'): an executemany whose parameters
    are an iterator (aiosqlite and sqlite3 take any iterable), in a deferred
    transaction (BEGIN held, sent with it), while another writer holds the
    lock. On the event loop the first row is drawn from the iterator, bound,
    and meets the lock; the rest is handed to the thread with the same,
    now advanced, iterator: the first row is never written, and no error
    says so."""
    path = tmp_path / "loop.db"
    async with engine.connect() as conn:
        await known_idle(conn)
        raw = await driver_of(conn)
        await raw.cursor().execute("BEGIN")  # held: goes with the executemany
        with WriteLockHolder(path):
            task = asyncio.ensure_future(
                raw.cursor().executemany(
                    "INSERT INTO t (v) VALUES (?)", iter([("a",), ("b",), ("c",)])
                )
            )
            await pending_for_a_while(task)
        await task
        await raw.commit()
    assert rows(path) == ["a", "b", "c"]


async def test_a_lone_executemany_step_from_an_iterator_outside_a_transaction(
    engine, tmp_path: Path
) -> None:
    """The same outside a transaction, through ``run_steps`` (one step)."""
    path = tmp_path / "loop.db"
    async with engine.connect() as conn:
        await known_idle(conn)
        raw = await driver_of(conn)
        with WriteLockHolder(path):
            task = asyncio.ensure_future(
                raw.run_steps(
                    [("executemany", "INSERT INTO t (v) VALUES (?)", iter([("a",), ("b",)]))]
                )
            )
            await pending_for_a_while(task)
        await task
    assert rows(path) == ["a", "b"]


# ------------------------------------------------------------------ defended


async def busy_timeout(raw: Any) -> int:
    ((_, rows_, _),) = await raw.run_steps([("execute", "PRAGMA busy_timeout", ())])
    return rows_[0][0]


async def test_defended_an_executemany_list_in_a_deferred_transaction_is_sent_once(
    engine, tmp_path: Path
) -> None:
    """A list (not an iterator): the first row meets the lock, no row had an
    effect, the thread sends all of them once."""
    path = tmp_path / "loop.db"
    async with engine.connect() as conn:
        await known_idle(conn)
        raw = await driver_of(conn)
        await raw.cursor().execute("BEGIN")
        with WriteLockHolder(path, row="theirs"):
            task = asyncio.ensure_future(
                raw.cursor().executemany("INSERT INTO t (v) VALUES (?)", [("a",), ("b",)])
            )
            assert await pending_for_a_while(task)
        await task
        await raw.commit()
        assert await busy_timeout(raw) == 0
    assert rows(path) == ["theirs", "a", "b"]


async def test_defended_a_cancelled_caller_whose_rest_waits_on_the_thread(
    engine, tmp_path: Path
) -> None:
    """The caller of a handed-over write is cancelled while the thread waits
    for the lock; another call on the same connection meanwhile must not run
    on the event loop (the thread still holds the connection), the write
    runs once, the busy timeout is 0 again after, and the rollback that
    follows undoes the write."""
    loop_thread = threading.get_ident()
    path = tmp_path / "loop.db"
    async with engine.connect() as conn:
        await known_idle(conn)
        raw = await driver_of(conn)
        await raw.cursor().execute("BEGIN IMMEDIATE")  # held
        with WriteLockHolder(path, row="theirs"):
            task = asyncio.ensure_future(raw.cursor().execute("INSERT INTO t (v) VALUES ('ours')"))
            await pending_for_a_while(task)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            other = asyncio.ensure_future(
                raw.run_steps([("execute", "SELECT thread(), count(*) FROM t", ())])
            )
            assert await pending_for_a_while(other)  # queued behind the waiting write
        ((_, seen, _),) = await other
        assert seen[0][0] != loop_thread and seen[0][1] == 2  # theirs + ours, in our txn
        await raw.rollback()
        assert await busy_timeout(raw) == 0
        assert not raw.in_transaction
    assert rows(path) == ["theirs"]


async def test_defended_the_busy_timeout_is_reset_after_a_failing_thread_call(
    engine, tmp_path: Path
) -> None:
    """The rest handed to the thread fails there (a constraint): the busy
    timeout is 0 again on the event loop after it."""
    path = tmp_path / "loop.db"
    async with engine.begin() as conn:
        await conn.exec_driver_sql("CREATE UNIQUE INDEX tv ON t (v)")
        await conn.exec_driver_sql("INSERT INTO t (v) VALUES ('dup')")
    async with engine.connect() as conn:
        await known_idle(conn)
        raw = await driver_of(conn)
        await raw.cursor().execute("BEGIN IMMEDIATE")
        with WriteLockHolder(path):
            task = asyncio.ensure_future(
                raw.run_steps([("execute", "INSERT INTO t (v) VALUES ('dup')", ())])
            )
            await pending_for_a_while(task)
        with pytest.raises(sqlite3.IntegrityError):
            await task
        await raw.rollback()
        assert await busy_timeout(raw) == 0
