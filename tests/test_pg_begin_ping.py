"""The store's PostgreSQL transactions begin in the trip that pings
(roundtable/store/pg_core.py, ``begun``): the pool's ping is left to the
BEGIN the borrower sends at once, so a transaction costs one round trip
fewer, and the BEGIN still does everything the ping did. tests/test_pg_ping.py
holds both paths to the ping's promises; these hold the BEGIN's own."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import make_url, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from roundtable.store import engine as engine_module
from roundtable.store import pg_core
from roundtable.store.database import Database
from roundtable.store.engine import create_engine_for


@pytest.fixture
async def engine(pg_engine: AsyncEngine) -> AsyncEngine:
    async with pg_engine.begin() as conn:
        await conn.execute(text("CREATE TABLE begun_rows (x int)"))
    return pg_engine


async def _pooled_raw(engine: AsyncEngine) -> tuple[int, Any]:
    """The pooled connection's backend pid and asyncpg connection, left in
    the pool (one connection, so the next checkout is lent it)."""
    async with engine.connect() as conn:
        pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        raw = (await conn.get_raw_connection()).driver_connection
    return pid, raw


def _logged(raw: Any) -> list[str]:
    """The simple queries ``raw`` sends from now on (asyncpg tells its query
    loggers of simple queries only, on the next loop turn)."""
    sent: list[str] = []
    raw.add_query_logger(lambda logged: sent.append(logged.query))
    return sent


async def _rows(engine: AsyncEngine) -> list[int]:
    async with engine.connect() as conn:
        return list((await conn.execute(text("SELECT x FROM begun_rows"))).scalars())


async def test_a_store_transaction_pings_with_its_begin_and_nothing_else(engine) -> None:
    _, raw = await _pooled_raw(engine)
    sent = _logged(raw)
    async with Database(engine).core_transaction() as (conn, _notes):
        await conn.execute(text("INSERT INTO begun_rows VALUES (1)"))
        isolation = (await conn.execute(text("SHOW transaction_isolation"))).scalar_one()
    await asyncio.sleep(0)
    assert sent == [f"BEGIN ISOLATION LEVEL READ COMMITTED; {pg_core._FRESH}", "COMMIT;"]
    assert isolation == "read committed"
    assert not raw.is_in_transaction()
    assert await _rows(engine) == [1]


@contextlib.asynccontextmanager
async def _writing(engine: AsyncEngine, way: str) -> AsyncIterator[Any]:
    """A store transaction, Core or ORM: something to ``execute`` on."""
    if way == "core":
        async with Database(engine).core_transaction() as (conn, _notes):
            yield conn
    else:
        async with Database(engine).transaction() as session:
            yield session


@pytest.mark.parametrize("way", ["core", "orm"])
async def test_a_failed_store_transaction_is_rolled_back(engine, way) -> None:
    _, raw = await _pooled_raw(engine)
    sent = _logged(raw)
    with pytest.raises(RuntimeError):
        async with _writing(engine, way) as conn:
            await conn.execute(text("INSERT INTO begun_rows VALUES (1)"))
            raise RuntimeError("the caller's own failure")
    await asyncio.sleep(0)
    assert sent[-1] == "ROLLBACK;"
    assert not raw.is_in_transaction()
    assert await _rows(engine) == []


async def test_a_store_read_pings_with_its_begin_and_is_rolled_back(engine) -> None:
    _, raw = await _pooled_raw(engine)
    sent = _logged(raw)
    async with Database(engine).core_reader() as conn:
        assert (await conn.execute(text("SELECT 41 + 1"))).scalar_one() == 42
    await asyncio.sleep(0)
    assert sent == [f"BEGIN READ ONLY; {pg_core._FRESH}", "ROLLBACK;"]


class _SilentCut:
    """A TCP relay to the server whose connections can be cut without a word
    to the client: the server's side is closed (its backend ends), the
    client's stays open until the client next sends, as a connection
    dropped by a firewall or a failover looks until it is used."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self._upstream = upstream
        self._relays: list[dict[str, Any]] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _relay(self, client_in: Any, client_out: Any) -> None:
        server_in, server_out = await asyncio.open_connection(*self._upstream)
        relay = {"cut": False, "server_out": server_out, "client_out": client_out}
        self._relays.append(relay)

        async def pump(source: Any, sink: Any, from_client: bool) -> None:
            try:
                while data := await source.read(65536):
                    if relay["cut"]:
                        break
                    sink.write(data)
                    await sink.drain()
            except ConnectionError:
                pass
            finally:
                if from_client or not relay["cut"]:
                    sink.close()
                if from_client and relay["cut"]:
                    client_out.transport.abort()  # the client's next word meets a dead line

        await asyncio.gather(pump(client_in, server_out, True), pump(server_in, client_out, False))

    def cut(self) -> None:
        for relay in self._relays:
            relay["cut"] = True
            relay["server_out"].close()

    async def stop(self) -> None:
        assert self._server is not None
        for relay in self._relays:
            relay["client_out"].transport.abort()
            relay["server_out"].close()
        self._server.close()


async def test_a_connection_lost_unseen_in_the_pool_is_replaced_at_the_begin(
    postgres_url, caplog
) -> None:
    url = make_url(postgres_url)
    cutter = _SilentCut((url.host, url.port))
    port = await cutter.start()
    engine = create_engine_for(url.set(port=port).render_as_string(hide_password=False))
    try:
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TABLE IF NOT EXISTS begun_rows (x int)"))
            await conn.execute(text("DELETE FROM begun_rows"))
        pid, raw = await _pooled_raw(engine)
        cutter.cut()
        await asyncio.sleep(0.2)  # the server's side is gone by now
        assert not raw.is_closed()  # and this side has not been told
        caplog.set_level(logging.INFO, logger="roundtable.store.pg_core")
        async with Database(engine).core_transaction() as (conn, _notes):
            assert (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one() != pid
            await conn.execute(text("INSERT INTO begun_rows VALUES (1)"))
        assert await _rows(engine) == [1]
        assert "was lost; replaced" in caplog.text  # found by the BEGIN, not a ping
    finally:
        await engine.dispose()
        await cutter.stop()


async def test_a_transaction_open_on_the_server_fails_the_begin_and_is_never_joined(
    engine, caplog
) -> None:
    """A borrower's transaction the last reply does not show (its BEGIN's
    reply still on its way when the pool checked): the BEGIN's check fails
    there, the connection is closed (its INSERT rolled back by the server),
    and the borrower is lent a pinged connection."""
    await _a_write_then_another_behind_a_reply_on_its_way(engine)
    assert await _rows(engine) == [2]
    assert "found inside a transaction, or failed, at its BEGIN" in caplog.text


async def _a_write_then_another_behind_a_reply_on_its_way(engine: AsyncEngine) -> None:
    """A borrower's BEGIN and INSERT (1) sent behind the adapter's back and
    cut off while the backend is frozen, so the reply is still on its way
    when the connection goes back to the pool; then a store transaction
    that inserts 2, on a connection other than that one."""
    pid, raw = await _pooled_raw(engine)
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await raw.execute("BEGIN; INSERT INTO begun_rows VALUES (1)")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert not raw.is_in_transaction()  # as far as the last reply says
    async with Database(engine).core_transaction() as (conn, _notes):
        assert (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one() != pid
        await conn.execute(text("INSERT INTO begun_rows VALUES (2)"))


async def test_the_check_is_not_fooled_by_a_schema_ahead_of_pg_catalog(
    postgres_url, caplog
) -> None:
    """A search_path that puts a schema before pg_catalog, holding a
    transaction_timestamp() of its own that always agrees: the check names
    pg_catalog's, so the borrower's transaction is still found."""
    engine = create_engine_for(postgres_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(text("CREATE SCHEMA shadow"))
            await conn.execute(
                text(
                    "CREATE FUNCTION shadow.transaction_timestamp() RETURNS timestamptz"
                    " LANGUAGE sql STABLE AS 'SELECT pg_catalog.statement_timestamp()'"
                )
            )
            await conn.execute(text("CREATE TABLE begun_rows (x int)"))
            database = (await conn.execute(text("SELECT current_database()"))).scalar_one()
            await conn.execute(
                text(f'ALTER DATABASE "{database}" SET search_path = shadow, pg_catalog, public')
            )
        await engine.dispose()  # new connections take the database's search_path
        await _a_write_then_another_behind_a_reply_on_its_way(engine)
        assert await _rows(engine) == [2]
        assert "found inside a transaction, or failed, at its BEGIN" in caplog.text
    finally:
        await engine.dispose()


async def test_a_begin_cut_off_by_a_cancellation_never_lends_its_connection(engine, caplog) -> None:
    """What the server did with a BEGIN cut off mid-flight is unknown: the
    connection is closed, and the next borrower is lent another."""
    pid, _ = await _pooled_raw(engine)
    os.kill(pid, signal.SIGSTOP)
    try:

        async def write() -> None:
            async with Database(engine).core_transaction() as (conn, _notes):
                await conn.execute(text("INSERT INTO begun_rows VALUES (1)"))

        task = asyncio.create_task(write())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        os.kill(pid, signal.SIGCONT)
    async with Database(engine).core_transaction() as (conn, _notes):
        assert (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one() != pid
        await conn.execute(text("INSERT INTO begun_rows VALUES (2)"))
    assert await _rows(engine) == [2]
    assert "was cut off at its BEGIN" in caplog.text


async def test_a_begin_that_is_not_answered_is_given_up_on_at_the_ping_time(
    engine, monkeypatch, caplog
) -> None:
    monkeypatch.setattr(engine_module, "PING_TIMEOUT_SECONDS", 0.5)
    pid, _ = await _pooled_raw(engine)
    os.kill(pid, signal.SIGSTOP)
    try:
        async with asyncio.timeout(30):  # the test's own bound, far above the ping's
            async with Database(engine).core_reader() as conn:
                assert (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one() != pid
    finally:
        os.kill(pid, signal.SIGCONT)
    assert "did not answer its ping (its BEGIN)" in caplog.text


async def test_under_autocommit_the_pool_pings_and_nothing_is_begun(engine) -> None:
    _, raw = await _pooled_raw(engine)
    sent = _logged(raw)
    async with pg_core.begun(engine, isolation_level="AUTOCOMMIT") as conn:
        await conn.execute(text("INSERT INTO begun_rows VALUES (1)"))
        assert not raw.is_in_transaction()
    await asyncio.sleep(0)
    assert sent == ["SELECT 1"]  # the pool's ping, for the connection lent
    assert await _rows(engine) == [1]


async def test_an_orm_transaction_pings_with_its_begin_and_commits(engine) -> None:
    _, raw = await _pooled_raw(engine)
    sent = _logged(raw)
    async with Database(engine).transaction() as session:
        await session.execute(text("INSERT INTO begun_rows VALUES (1)"))
    await asyncio.sleep(0)
    assert sent == [f"BEGIN ISOLATION LEVEL READ COMMITTED; {pg_core._FRESH}", "COMMIT;"]
    assert not raw.is_in_transaction()
    assert await _rows(engine) == [1]


async def test_a_snapshot_pings_with_its_begin_at_repeatable_read(engine) -> None:
    _, raw = await _pooled_raw(engine)
    sent = _logged(raw)
    async with Database(engine).snapshot() as session:
        level = (await session.execute(text("SHOW transaction_isolation"))).scalar_one()
    await asyncio.sleep(0)
    assert level == "repeatable read"
    assert sent[0] == f"BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; {pg_core._FRESH}"
    assert not raw.is_in_transaction()


async def test_a_read_only_flag_asked_for_after_the_begin_reaches_the_transaction(engine) -> None:
    """Set on the session's connection before its first statement (the
    only time SQLAlchemy allows it), after the BEGIN went without it: the
    BEGIN is rolled back and the transaction begins read-only."""
    with pytest.raises(DBAPIError, match="read-only transaction"):
        async with Database(engine).transaction() as session:
            await session.connection(execution_options={"postgresql_readonly": True})
            only = (await session.execute(text("SHOW transaction_read_only"))).scalar_one()
            assert only == "on"
            await session.execute(text("INSERT INTO begun_rows VALUES (1)"))
    assert await _rows(engine) == []
    async with Database(engine).transaction() as session:  # the flag went with its borrower
        await session.execute(text("INSERT INTO begun_rows VALUES (2)"))
    assert await _rows(engine) == [2]


async def test_a_snapshot_sees_the_instant_its_block_was_entered(engine) -> None:
    async with Database(engine).snapshot() as session:
        async with engine.begin() as other:
            await other.execute(text("INSERT INTO begun_rows VALUES (1)"))
        seen = (await session.execute(text("SELECT count(*) FROM begun_rows"))).scalar_one()
    assert seen == 0
    assert await _rows(engine) == [1]
