"""The SQLite claim's floor: what a claim would cost if none of its Python
ran, only its statements.

The claim's statements are recorded as the driver sends them to SQLite
(with their parameters) while the store claims, then replayed with plain
``sqlite3`` on a copy of the database taken before the claims, with the
engine's pragmas: that is the time SQLite itself spends on a claim (its
read, its six writes, the commit writing every page they touched). The bare
upsert is replayed the same way. The floor of the claim, measured as the
bench measures it, is then the bare upsert's whole time with its own SQLite
time swapped for the claim's: what the store would cost if its claim added
no Python to the one-statement transaction's.

    floor ratio = baseline time / (baseline time - upsert's SQLite time + claim's SQLite time)

Cutting the claim's Python can bring its ratio up to this, no further;
past it only fewer statements, or fewer pages written, would go.
"""

from __future__ import annotations

import shutil
import sqlite3
import statistics
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from roundtable.store.sqlite_driver import OneTripConnection

# (method, sql, parameters); method "begin" for a transaction's BEGIN
Statement = tuple[str, str, Any]

REPLAYS = 3  # each on a fresh copy; the median taken


@contextmanager
def recording() -> Iterator[list[list[Statement]]]:
    """Every statement the driver's trips send while the block runs, one
    list per transaction (a new one at each BEGIN). Recorded below the
    functions the driver decides where to run by (``_steps``, ``_run``),
    so a call still runs where it would."""
    sent: list[list[Statement]] = []
    steps_from, opened = OneTripConnection._steps_from, OneTripConnection._open

    def recorded_steps(
        self: Any, steps: list[Statement], commit: bool, start: int, done: list[Any]
    ) -> Any:
        sent[-1].extend(steps[start:])
        return steps_from(self, steps, commit, start, done)

    def recorded_open(self: Any, begin: str) -> None:
        sent.append([("begin", begin, None)])
        opened(self, begin)

    OneTripConnection._steps_from = recorded_steps  # type: ignore[method-assign]
    OneTripConnection._open = recorded_open  # type: ignore[method-assign]
    try:
        yield sent
    finally:
        OneTripConnection._steps_from = steps_from  # type: ignore[method-assign]
        OneTripConnection._open = opened  # type: ignore[method-assign]


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
            (
                "execute",
                "INSERT INTO floor_leases (target_key, holder) VALUES (?, ?) "
                "ON CONFLICT (target_key) DO NOTHING",
                (f"floor-{uuid.uuid4()}", "x"),
            ),
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
        connection.execute(
            "CREATE TABLE floor_leases (target_key VARCHAR(128) PRIMARY KEY, holder VARCHAR(64))"
        )
        connection.close()
        claim_times.append(_replayed(fresh, claims) / len(claims))
        upsert_times.append(_replayed(fresh, _upserts(len(claims))) / len(claims))
    return {
        "claim_s": statistics.median(claim_times),
        "upsert_s": statistics.median(upsert_times),
    }


def floor_ratio(baseline_per_s: float, sqlite: dict[str, float]) -> float:
    """The module docstring's formula: the bare upsert's rate against a claim
    that costs the upsert's time with the claim's SQLite time for its own."""
    baseline_s = 1 / baseline_per_s
    return baseline_s / (baseline_s - sqlite["upsert_s"] + sqlite["claim_s"])
