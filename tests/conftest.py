"""Shared fixtures: every store test runs on SQLite *and* PostgreSQL.

PostgreSQL comes from ``ROUNDTABLE_TEST_DATABASE_URL`` when set (an existing
server; each test gets a fresh database created on it), otherwise from a
throwaway cluster this suite starts. With ``CI=true`` a PostgreSQL that cannot
be reached fails the run instead of skipping.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from roundtable.store import Store, open_store
from roundtable.store.engine import create_engine_for
from roundtable.store.sqlite_driver import OneTripConnection
from tests.ci import unavailable
from tests.pg_cluster import PgCluster, PostgresUnavailable, start_cluster

# Failures, slow tests and the machine's state printed as they happen (CI logs).
pytest_plugins = ["tests.run_watch"]

TEST_SECRET = "test-only-action-secret-please-rotate"
_PG_STATE: dict[str, object] = {}


def _admin_url() -> str:
    """A postgresql+asyncpg URL for a database we may CREATE DATABASE from."""
    if "url" in _PG_STATE:
        return str(_PG_STATE["url"])
    if "error" in _PG_STATE:
        raise PostgresUnavailable(str(_PG_STATE["error"]))
    try:
        external = os.environ.get("ROUNDTABLE_TEST_DATABASE_URL")
        if external:
            url = external
        else:
            cluster = start_cluster()
            _PG_STATE["cluster"] = cluster
            url = cluster.url()
        _PG_STATE["version"] = asyncio.run(_server_version(url))
        _PG_STATE["url"] = url
        return url
    except (PostgresUnavailable, OSError, asyncpg.PostgresError) as exc:
        _PG_STATE["error"] = exc
        raise PostgresUnavailable(str(exc)) from exc


def _asyncpg_dsn(url: str, database: str | None = None) -> str:
    parsed = make_url(url).set(drivername="postgresql")
    if database is not None:
        parsed = parsed.set(database=database)
    return parsed.render_as_string(hide_password=False)


async def _server_version(url: str) -> str:
    conn = await asyncpg.connect(_asyncpg_dsn(url))
    try:
        return await conn.fetchval("SELECT version()")
    finally:
        await conn.close()


def pytest_report_header(config: pytest.Config) -> list[str]:
    try:
        _admin_url()
    except PostgresUnavailable as exc:
        return [f"postgresql: UNAVAILABLE ({exc})"]
    source = "ROUNDTABLE_TEST_DATABASE_URL" if "cluster" not in _PG_STATE else "throwaway cluster"
    return [f"postgresql: {_PG_STATE['version']} ({source})"]


def pytest_unconfigure(config: pytest.Config) -> None:
    cluster = _PG_STATE.get("cluster")
    if isinstance(cluster, PgCluster):
        cluster.stop()


@pytest.fixture(autouse=True)
def action_secret(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("ROUNDTABLE_ACTION_SECRET_KEY", TEST_SECRET)
    return TEST_SECRET


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test."""
    try:
        admin = _admin_url()
    except PostgresUnavailable as exc:
        unavailable("PostgreSQL", f"{exc}; make test installs it")
    name = f"rt_{uuid.uuid4().hex[:16]}"

    async def admin_sql(sql: str) -> None:
        conn = await asyncpg.connect(_asyncpg_dsn(admin))
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(admin_sql(f'CREATE DATABASE "{name}"'))
    yield make_url(admin).set(database=name).render_as_string(hide_password=False)
    asyncio.run(admin_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
async def pg_engine(postgres_url: str) -> AsyncIterator[AsyncEngine]:
    """The store's engine (create_engine_for) on a fresh PostgreSQL database."""
    made = create_engine_for(postgres_url)
    yield made
    await made.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'roundtable.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[Store]:
    async with open_store(database_url) as opened:
        yield opened


@pytest.fixture
def trips(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every call queued for a SQLite connection's thread (sqlite_driver.py), by
    name: what a trip to SQLite's thread is, counted."""
    seen: list[str] = []
    queue = OneTripConnection._execute

    async def counted(self, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "?")
        seen.append(name)
        return await queue(self, fn, *args, **kwargs)

    monkeypatch.setattr(OneTripConnection, "_execute", counted)
    return seen
