"""The claim's floor: what a claim would cost if none of its Python ran,
only its statements, on SQLite and on PostgreSQL.

The claim's statements are recorded as the store sends them (with their
parameters) while it claims, then replayed with the database's plainest
client on a copy of the database taken before the claims: plain
``sqlite3`` with the engine's pragmas; ``asyncpg`` alone, at READ
COMMITTED, one connection or eight. That is the time the database (and the
least of a client) spends on a claim: its read and six writes and the
commit that writes every page they touched on SQLite, its locking
statement and its checking-and-writing one on PostgreSQL. The bare upsert
is replayed the same way. The floor of the claim, measured as the bench
measures it, is then the bare upsert's whole time with its replayed time
swapped for the claim's: what the store would cost if its claim added no
Python to the one-statement transaction's.

    floor ratio = baseline time / (baseline time - upsert replayed + claim replayed)

(times per claim; with eight claimers at once, the inverse of each rate).
Cutting the claim's Python can bring its ratio up to this, no further;
past it only fewer statements, or less work in them, would go.
"""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import statistics
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import asyncpg

from roundtable.store.pg_core import PostgresCoreConnection
from roundtable.store.sqlite_driver import OneTripConnection

# (method, sql, parameters); method "begin" for a transaction's BEGIN
Statement = tuple[str, str, Any]

REPLAYS = 3  # each on a fresh copy; the median taken
# The bare lease bench.claims measures against, and the floor replays.
BARE_LEASES = "(target_key VARCHAR(128) PRIMARY KEY, holder VARCHAR(64))"


def bare_upsert(table: str, key: str, holder: str) -> str:
    """The bare lease's one statement, with the driver's placeholders."""
    # Names and placeholders from this code only, never a value.
    return (
        f"INSERT INTO {table} (target_key, holder) VALUES ({key}, {holder}) "  # noqa: S608
        "ON CONFLICT (target_key) DO NOTHING"
    )


CLAIMERS = 8  # as bench.claims' concurrent pass


@contextmanager
def recording() -> Iterator[list[list[Statement]]]:
    """Every statement the driver's trips send while the block runs, one
    list per transaction (a new one at each BEGIN). Recorded where a call is
    made, once, above what a lock found taken would run again on the thread
    (``_steps_from``, ``_begun``), and outside the functions the driver
    decides where to run by (``_steps``, ``_run``), so a call still runs
    where it would."""
    sent: list[list[Statement]] = []
    execute, run_steps = OneTripConnection._execute, OneTripConnection.run_steps

    async def recorded_execute(self: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self._begin is not None:  # held back, and sent first in this call's trip
            sent.append([("begin", self._begin, None)])
        return await execute(self, fn, *args, **kwargs)

    async def recorded_steps(self: Any, steps: list[Statement], commit: bool = False) -> Any:
        if self._begin is None and not self._conn.in_transaction:
            raise RuntimeError("statements outside a transaction: not a claim's")
        answer = await run_steps(self, steps, commit)  # its BEGIN recorded first, by _execute
        sent[-1].extend(steps)
        return answer

    OneTripConnection._execute = recorded_execute  # type: ignore[method-assign]
    OneTripConnection.run_steps = recorded_steps  # type: ignore[method-assign]
    try:
        yield sent
    finally:
        OneTripConnection._execute = execute  # type: ignore[method-assign]
        OneTripConnection.run_steps = run_steps  # type: ignore[method-assign]


def snapshot(database: Path, copy: Path) -> None:
    """A consistent copy of ``database`` (its WAL included), taken with
    SQLite's backup while the store's engine is still open."""
    source, target = sqlite3.connect(database), sqlite3.connect(copy)
    try:
        source.backup(target)
    finally:
        target.close()
        source.close()


def _connect(path: Path) -> sqlite3.Connection:
    # As the engine's connect listener sets a connection up (engine.py).
    connection = sqlite3.connect(path, isolation_level=None)
    for pragma in ("journal_mode=WAL", "foreign_keys=ON", "synchronous=NORMAL"):
        connection.execute(f"PRAGMA {pragma}")
    return connection


def _replayed(path: Path, transactions: list[list[Statement]]) -> float:
    """Seconds SQLite takes for ``transactions``, each committed."""
    connection = _connect(path)
    try:
        started = time.perf_counter()
        for statements in transactions:
            for method, sql, parameters in statements:
                if method == "begin":
                    connection.execute(sql)
                    continue
                cursor = connection.cursor()
                getattr(cursor, method)(sql, parameters)
                cursor.fetchall()
                cursor.close()
            connection.execute("COMMIT")
        return time.perf_counter() - started
    finally:
        connection.close()


def _upserts(count: int) -> list[list[Statement]]:
    return [
        [
            ("begin", "BEGIN IMMEDIATE", None),
            ("execute", bare_upsert("floor_leases", "?", "?"), (f"floor-{uuid.uuid4()}", "x")),
        ]
        for _ in range(count)
    ]


def sqlite_seconds(copy: Path, claims: list[list[Statement]]) -> dict[str, float]:
    """SQLite's own time for one recorded claim and for one bare upsert, each
    the median of :data:`REPLAYS` replays on a fresh copy of ``copy``."""
    claim_times, upsert_times = [], []
    for number in range(REPLAYS):
        fresh = copy.with_name(f"replay-{number}.db")
        shutil.copy(copy, fresh)
        connection = _connect(fresh)
        connection.execute(f"CREATE TABLE floor_leases {BARE_LEASES}")
        connection.close()
        claim_times.append(_replayed(fresh, claims) / len(claims))
        upsert_times.append(_replayed(fresh, _upserts(len(claims))) / len(claims))
    return {
        "claim_s": statistics.median(claim_times),
        "upsert_s": statistics.median(upsert_times),
    }


def floor_ratio(baseline_per_s: float, replayed: dict[str, float]) -> float:
    """The module docstring's formula: the bare upsert's rate against a claim
    that costs the upsert's time with the claim's replayed time for its own."""
    baseline_s = 1 / baseline_per_s
    return baseline_s / (baseline_s - replayed["upsert_s"] + replayed["claim_s"])


# ----------------------------------------------------------- PostgreSQL

# (SQL in asyncpg's $n style, its parameters, whether executemany)
Sent = tuple[str, Any, bool]


@contextmanager
def recording_postgresql() -> Iterator[list[list[Sent]]]:
    """Every statement the store's PostgreSQL connections send while the
    block runs, one list per transaction (a new one where the statement
    opens the transaction, as asyncpg's adapter does on the first, or is
    the first in one begun with the checkout's ping, pg_core.begun)."""
    sent: list[list[Sent]] = []
    send = PostgresCoreConnection._send
    current: list[Any] = [None]  # the transaction the last statement went in

    async def recorded(self: Any, sql: str, bound: Any, many: bool) -> Any:
        begun = self._adapted._transaction
        if begun is None or begun is not current[0]:
            sent.append([])
        sent[-1].append((sql, bound, many))
        try:
            return await send(self, sql, bound, many)
        finally:
            current[0] = self._adapted._transaction

    PostgresCoreConnection._send = recorded  # type: ignore[method-assign]
    try:
        yield sent
    finally:
        PostgresCoreConnection._send = send  # type: ignore[method-assign]


async def _on_template1(dsn: str, *statements: str) -> None:
    """``statements``, through the cluster's template1 (a database cannot be
    made from, or dropped by, a connection to itself)."""
    admin = await asyncpg.connect(dsn.rsplit("/", 1)[0] + "/template1")
    try:
        for statement in statements:
            await admin.execute(statement)
    finally:
        await admin.close()


async def copy_database(dsn: str, copy: str) -> None:
    """``copy``, a new database made from ``dsn``'s (nobody may be connected
    to it)."""
    source = dsn.rsplit("/", 1)[1]
    await _on_template1(
        dsn, f'DROP DATABASE IF EXISTS "{copy}"', f'CREATE DATABASE "{copy}" TEMPLATE "{source}"'
    )


async def drop_database(dsn: str, copy: str) -> None:
    await _on_template1(dsn, f'DROP DATABASE IF EXISTS "{copy}" WITH (FORCE)')


async def _replayed_postgresql(dsn: str, transactions: list[list[Sent]], claimers: int) -> float:
    """Seconds asyncpg alone takes for ``transactions``, each at READ
    COMMITTED (as the claim's), by ``claimers`` connections at once."""
    connections = [await asyncpg.connect(dsn) for _ in range(claimers)]
    idle: asyncio.Queue[Any] = asyncio.Queue()
    for connection in connections:
        idle.put_nowait(connection)

    async def one(statements: list[Sent]) -> None:
        connection = await idle.get()
        try:
            async with connection.transaction(isolation="read_committed"):
                for sql, bound, many in statements:
                    if many:
                        await connection.executemany(sql, bound)
                    else:
                        await connection.fetch(sql, *bound)
        finally:
            idle.put_nowait(connection)

    try:
        started = time.perf_counter()
        await asyncio.gather(*(one(statements) for statements in transactions))
        return time.perf_counter() - started
    finally:
        for connection in connections:
            await connection.close()


async def postgresql_seconds(
    dsn: str, claims: list[list[Sent]], concurrent: bool
) -> dict[str, float]:
    """asyncpg's time alone (a claim's, a bare upsert's) replaying ``claims``
    on ``dsn``, a copy taken before them, then as many upserts; per claim
    sequentially, the inverse of the rate with :data:`CLAIMERS` at once."""
    claimers = CLAIMERS if concurrent else 1
    claim_s = await _replayed_postgresql(dsn, claims, claimers) / len(claims)
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute(f"CREATE TABLE floor_leases {BARE_LEASES}")
    finally:
        await connection.close()
    upsert = bare_upsert("floor_leases", "$1", "$2")
    upserts: list[list[Sent]] = [[(upsert, (f"floor-{uuid.uuid4()}", "x"), False)] for _ in claims]
    upsert_s = await _replayed_postgresql(dsn, upserts, claimers) / len(claims)
    return {"claim_s": claim_s, "upsert_s": upsert_s}
