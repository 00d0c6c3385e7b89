"""The pool's pre-ping on PostgreSQL (roundtable/store/engine.py,
``_one_trip_ping``): one simple query per checkout instead of SQLAlchemy's
three round trips, and still what a pre-ping is for: a pooled connection
whose backend is gone is replaced before anyone is lent it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import asyncpg
import pytest
from sqlalchemy import exc, text
from sqlalchemy.ext.asyncio import AsyncEngine

from roundtable.store import engine as engine_module
from roundtable.store.database import Database
from roundtable.store.engine import create_engine_for


@pytest.fixture
def engine(pg_engine: AsyncEngine) -> AsyncEngine:
    return pg_engine


async def _pid_and_raw(engine: AsyncEngine) -> tuple[int, Any]:
    async with engine.connect() as conn:
        pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        raw = (await conn.get_raw_connection()).driver_connection
    return pid, raw


async def _terminate(postgres_url: str, *pids: int) -> None:
    killer = await asyncpg.connect(postgres_url.replace("postgresql+asyncpg", "postgresql"))
    try:
        for pid in pids:
            await killer.execute(f"SELECT pg_terminate_backend({pid})")
    finally:
        await killer.close()


async def test_a_checkout_pings_with_one_simple_query_and_nothing_else(engine) -> None:
    _, raw = await _pid_and_raw(engine)
    sent: list[str] = []
    raw.add_query_logger(lambda logged: sent.append(logged.query))
    async with engine.connect() as conn:
        await asyncio.sleep(0)  # asyncpg tells its loggers on the next loop turn
        assert sent == ["SELECT 1"]  # the ping, before anything of ours
        assert (await conn.get_raw_connection()).driver_connection is raw
        assert not raw.is_in_transaction()  # it left no transaction open
        await conn.execute(text("SELECT 2"))
    await asyncio.sleep(0)
    # Then our transaction (asyncpg does not tell its loggers of prepared
    # statements): no second ping, no ping of three trips.
    assert sent == ["SELECT 1", "BEGIN;", "ROLLBACK;"]


async def test_a_pooled_connection_whose_backend_died_is_replaced_unseen(
    engine, postgres_url
) -> None:
    async with engine.connect() as first, engine.connect() as second:
        pids = [
            (await c.execute(text("SELECT pg_backend_pid()"))).scalar_one() for c in (first, second)
        ]
    assert engine.pool.checkedin() == 2
    await _terminate(postgres_url, *pids)  # both die while they wait in the pool
    async with engine.connect() as first, engine.connect() as second:
        now = [
            (await c.execute(text("SELECT pg_backend_pid()"))).scalar_one() for c in (first, second)
        ]
    assert not set(now) & set(pids)


async def test_a_store_transaction_after_a_lost_backend_commits(engine, postgres_url) -> None:
    """The store's own path (the fast connection) is lent the fresh one."""
    pid, _ = await _pid_and_raw(engine)
    await _terminate(postgres_url, pid)
    async with Database(engine).core_transaction() as (conn, _notes):
        assert (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one() != pid


async def test_a_ping_that_fails_for_another_reason_is_raised_not_retried(
    engine, monkeypatch
) -> None:
    """Only a lost connection is replaced: any other error of the ping
    reaches the caller as SQLAlchemy's own class, as with its own ping."""
    pid, raw = await _pid_and_raw(engine)
    own = type(raw).execute

    async def refusing(self: Any, query: str, *args: Any, **kwargs: Any) -> str:
        if self is raw and query == "SELECT 1":
            raise asyncpg.exceptions.InsufficientPrivilegeError("not allowed")
        return await own(self, query, *args, **kwargs)

    monkeypatch.setattr(type(raw), "execute", refusing)
    with pytest.raises(exc.ProgrammingError):
        async with engine.connect():
            pass
    monkeypatch.undo()
    # The pool drops a connection whose checkout failed, as it does after
    # its own ping fails; the next checkout is lent a new one.
    assert (await _pid_and_raw(engine))[0] != pid


async def _left_inside_a_transaction(engine: AsyncEngine, how: str) -> int:
    """A borrower that begins a server transaction behind the adapter's back
    (which the pool's reset on return cannot see) and gives the connection
    back in it; the backend's pid."""
    async with engine.connect() as conn:
        raw = (await conn.get_raw_connection()).driver_connection
        pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        await conn.rollback()
        if how == "autocommit_begin":  # BEGIN sent as a statement on AUTOCOMMIT
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            await conn.exec_driver_sql("BEGIN")
            await conn.exec_driver_sql("INSERT INTO left_behind VALUES (1)")
        elif how == "failed":  # and the transaction then failed
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            await conn.exec_driver_sql("BEGIN")
            with pytest.raises(exc.DBAPIError):
                await conn.exec_driver_sql("SELECT 1/0")
        else:  # on the driver's own connection
            await raw.execute("BEGIN; INSERT INTO left_behind VALUES (1)")
        assert raw.is_in_transaction()
    return pid


@pytest.mark.parametrize("how", ["autocommit_begin", "failed", "driver"])
async def test_a_connection_given_back_inside_a_transaction_is_never_lent(
    engine, how, caplog
) -> None:
    """Its transaction is rolled back by the server, not committed or used by
    the next borrower, and every next borrower has a clean connection."""
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE IF NOT EXISTS left_behind (x int)"))
    pid = await _left_inside_a_transaction(engine, how)
    for _ in range(3):
        async with Database(engine).core_transaction() as (conn, _notes):
            assert (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one() != pid
            await conn.execute(text("INSERT INTO left_behind VALUES (2)"))
        async with engine.connect() as conn:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            raw = (await conn.get_raw_connection()).driver_connection
            assert not raw.is_in_transaction()
            rows = (await conn.execute(text("SELECT x FROM left_behind"))).scalars().all()
    assert rows == [2, 2, 2]  # the abandoned INSERT never committed
    assert "found inside a transaction" in caplog.text


async def test_a_pooled_connection_that_does_not_answer_is_replaced(
    engine, monkeypatch, caplog
) -> None:
    """A backend that is frozen (as a connection cut without a word looks
    from here) is taken for lost once the ping's time is up, not waited on
    for ever, and the borrower is lent a new connection."""
    monkeypatch.setattr(engine_module, "PING_TIMEOUT_SECONDS", 0.5)
    pid, _ = await _pid_and_raw(engine)
    os.kill(pid, signal.SIGSTOP)
    try:
        async with asyncio.timeout(30):  # the test's own bound, far above the ping's
            async with Database(engine).core_transaction() as (conn, _notes):
                now = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert now != pid
    assert "did not answer its ping" in caplog.text


async def test_a_pooled_connection_the_driver_already_closed_is_replaced_unseen(engine) -> None:
    pid, raw = await _pid_and_raw(engine)
    raw.terminate()  # as asyncpg does itself after some failures
    assert (await _pid_and_raw(engine))[0] != pid


async def test_a_transaction_begun_by_a_reply_still_on_its_way_is_caught(engine, caplog) -> None:
    """The state a connection last reported can be older than a reply still
    on its way: a borrower's BEGIN sent behind the adapter's back, cut off by
    a timeout while its backend is frozen, and the connection lent again at
    once. SELECT 1's own reply says where the server is; the connection is
    closed, not lent inside that transaction."""
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE IF NOT EXISTS in_flight (x int)"))
    pid, _ = await _pid_and_raw(engine)
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3), engine.connect() as conn:
                raw = (await conn.get_raw_connection()).driver_connection
                os.kill(pid, signal.SIGSTOP)  # after the checkout's ping
                await raw.execute("BEGIN; INSERT INTO in_flight VALUES (1)")
    finally:
        os.kill(pid, signal.SIGCONT)
    # The backend answers now; this loop does not read the answer before the
    # next checkout's ping (no await in between).
    time.sleep(0.2)  # noqa: ASYNC251
    async with Database(engine).core_transaction() as (conn, _notes):
        assert (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one() != pid
        await conn.execute(text("INSERT INTO in_flight VALUES (2)"))
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT x FROM in_flight"))).scalars().all() == [2]
    assert "found inside a transaction" in caplog.text


async def test_a_shorter_command_timeout_bounds_the_ping(postgres_url, monkeypatch) -> None:
    """``?command_timeout=`` shorter than the ping's own: the ping waits no
    longer than the connection's owner asked any statement to wait."""
    monkeypatch.setattr(engine_module, "PING_TIMEOUT_SECONDS", 600.0)
    engine = create_engine_for(f"{postgres_url}?command_timeout=0.5")
    try:
        pid, _ = await _pid_and_raw(engine)
        os.kill(pid, signal.SIGSTOP)
        try:
            async with asyncio.timeout(60):  # far above 0.5, far below 600
                assert (await _pid_and_raw(engine))[0] != pid
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        await engine.dispose()
