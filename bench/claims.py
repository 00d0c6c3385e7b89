"""How much the safety costs: the store's claim (run lock, checks, lease,
fencing token, audit event, all in one transaction) against a bare
single-statement lease upsert on the same database, in the same process.

    .venv/bin/python -m bench.claims [--claims N] [--postgresql URL]

Prints claims per second for both and the ratio (store / baseline); machines
here are noisy, so compare ratios, not absolute numbers. With no
--postgresql URL it starts a throwaway cluster when PostgreSQL is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import event, text

from roundtable.config import SECRET_ENV_VAR as SECRET_ENV
from roundtable.store import open_store


async def _store_claims(url: str, claims: int, concurrent: bool) -> float:
    async with open_store(url) as store:
        session = await store.create_session(user_id="bench", task_text="bench")
        runs = [
            await store.create_run(session_id=session["id"], user_id="bench") for _ in range(10)
        ]
        actions = [
            await store.create_action(
                {
                    "session_id": session["id"],
                    "run_id": runs[i % 10]["id"],
                    "agent_id": "seat",
                    "tool_name": "bench",
                    "idempotency_key": f"bench-{uuid.uuid4()}",
                    # A fresh target each: an earlier pass's leases stay (nothing records a
                    # result here), and a taken target would measure a refusal.
                    "target_key": f"target:v1:{uuid.uuid4().hex * 2}",
                    "risk_level": "R1",
                    "status": "approved",
                }
            )
            for i in range(claims)
        ]
        with _counting(store.engine) as statements:
            started = time.perf_counter()
            if concurrent:
                claiming = (store.claim_action_for_execution(a["id"], 30) for a in actions)
                await asyncio.gather(*claiming)
            else:
                for action in actions:
                    await store.claim_action_for_execution(action["id"], 30)
            elapsed = time.perf_counter() - started
        return claims / elapsed, statements[0] / claims


async def _baseline_claims(url: str, claims: int, concurrent: bool) -> float:
    """The least a lease can cost: one upsert into a bare table."""
    async with open_store(url) as store:
        async with store.engine.begin() as conn:
            await conn.execute(
                text(
                    "CREATE TABLE IF NOT EXISTS bench_leases "
                    "(target_key VARCHAR(128) PRIMARY KEY, holder VARCHAR(64))"
                )
            )
        statement = text(
            "INSERT INTO bench_leases (target_key, holder) VALUES (:k, :h) "
            "ON CONFLICT (target_key) DO NOTHING"
        )

        async def one(i: int) -> None:
            async with store.engine.begin() as conn:
                await conn.execute(statement, {"k": f"baseline-{uuid.uuid4()}-{i}", "h": "x"})

        with _counting(store.engine) as statements:
            started = time.perf_counter()
            if concurrent:
                await asyncio.gather(*(one(i) for i in range(claims)))
            else:
                for i in range(claims):
                    await one(i)
            elapsed = time.perf_counter() - started
        return claims / elapsed, statements[0] / claims


@contextmanager
def _counting(engine: Any) -> Iterator[list[int]]:
    """Statements sent to the database while the block runs (SQLAlchemy's
    cursor events: every statement, BEGIN IMMEDIATE on SQLite included; on
    PostgreSQL asyncpg also sends BEGIN and COMMIT, which these do not see)."""
    seen = [0]

    def count(*_: Any) -> None:
        seen[0] += 1

    event.listen(engine.sync_engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", count)


async def _compare(label: str, url: str, claims: int) -> None:
    for concurrent in (False, True):
        mode = "50 concurrent" if concurrent else "sequential"
        count = 50 if concurrent else claims
        store_rate, store_statements = await _store_claims(url, count, concurrent)
        base_rate, base_statements = await _baseline_claims(url, count, concurrent)
        print(
            f"{label:<11} {mode:<14} store {store_rate:8.0f}/s  baseline {base_rate:8.0f}/s"
            f"  ratio {store_rate / base_rate:5.2f}"
            f"  statements/claim store {store_statements:4.1f} baseline {base_statements:3.1f}"
        )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--claims", type=int, default=300)
    parser.add_argument("--postgresql", help="postgresql+asyncpg:// URL (a database to use)")
    args = parser.parse_args()
    os.environ.setdefault(SECRET_ENV, "benchmark-only-secret-not-for-use")
    with tempfile.TemporaryDirectory() as tmp:
        await _compare("sqlite", f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}", args.claims)
    if args.postgresql:
        await _compare("postgresql", args.postgresql, args.claims)
        return
    try:
        from tests.pg_cluster import PostgresUnavailable, start_cluster
    except ImportError:
        print("postgresql  (skipped: run from the repository root for a throwaway cluster)")
        return
    try:
        cluster = start_cluster()
    except PostgresUnavailable as exc:
        print(f"postgresql  (skipped: {exc})")
        return
    try:
        await _compare("postgresql", cluster.url(), args.claims)
    finally:
        cluster.stop()


if __name__ == "__main__":
    asyncio.run(main())
