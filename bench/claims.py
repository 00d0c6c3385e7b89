"""How much the safety costs: the store's claim as the executor makes it
(``claim_for_execution``: run lock, checks, lease, fencing token, audit
event, and the action and its sealed arguments read back, all in one
transaction) against a bare single-statement lease upsert on the same
database, in the same process.

    .venv/bin/python -m bench.claims [--claims N] [--postgresql URL]

Prints claims per second for both and the ratio (store / baseline), and the
statements and round trips each claim takes; machines here are noisy, so
compare ratios, not absolute numbers. With no
--postgresql URL it starts a throwaway cluster when PostgreSQL is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import asyncpg
from sqlalchemy import event, make_url, text

from bench import claim_floor
from roundtable.config import SECRET_ENV_VAR as SECRET_ENV
from roundtable.config import PoolSizing
from roundtable.store import open_store
from roundtable.store.engine import PING_LEFT_TO_BEGIN
from roundtable.store.leases import ClaimOutcome
from roundtable.store.sqlite_driver import OneTripConnection


async def _claimable(store: Any, claims: int) -> list[dict[str, Any]]:
    """``claims`` approved actions, each of a run of its own (an executor's
    claims come from different runs; claims of one run would queue on its
    lock, a cost of this setup, not of the claim) and on a fresh target (an
    earlier pass's leases stay, nothing records a result here, and a taken
    target would measure a refusal)."""
    session = await store.create_session(user_id="bench", task_text="bench")
    runs = [
        await store.create_run(session_id=session["id"], user_id="bench") for _ in range(claims)
    ]
    return [
        await store.create_action(
            {
                "session_id": session["id"],
                "run_id": runs[i]["id"],
                "agent_id": "seat",
                "tool_name": "bench",
                "idempotency_key": f"bench-{uuid.uuid4()}",
                "target_key": f"target:v1:{uuid.uuid4().hex * 2}",
                "risk_level": "R1",
                "status": "approved",
            }
        )
        for i in range(claims)
    ]


async def _store_claims(store: Any, claims: int, concurrent: bool) -> tuple[float, float, float]:
    actions = await _claimable(store, claims)
    with _counting(store.engine) as statements:
        started = time.perf_counter()
        if concurrent:
            claiming = [store.claim_for_execution(a["id"], 30) for a in actions]
            await _bounded(claiming, CLAIMERS)
        else:
            for action in actions:
                await store.claim_for_execution(action["id"], 30)
        elapsed = time.perf_counter() - started
    return claims / elapsed, statements[0] / claims, statements[1] / claims


async def _baseline_claims(store: Any, claims: int, concurrent: bool) -> tuple[float, float, float]:
    """The least a lease can cost: one upsert into a bare table."""
    async with store.engine.begin() as conn:
        table = f"CREATE TABLE IF NOT EXISTS bench_leases {claim_floor.BARE_LEASES}"
        await conn.execute(text(table))
    statement = text(claim_floor.bare_upsert("bench_leases", ":k", ":h"))

    async def one(i: int) -> None:
        async with store.engine.begin() as conn:
            await conn.execute(statement, {"k": f"baseline-{uuid.uuid4()}-{i}", "h": "x"})

    with _counting(store.engine) as statements:
        started = time.perf_counter()
        if concurrent:
            await _bounded([one(i) for i in range(claims)], CLAIMERS)
        else:
            for i in range(claims):
                await one(i)
        elapsed = time.perf_counter() - started
    return claims / elapsed, statements[0] / claims, statements[1] / claims


async def _replayed(url: str, claims: int, concurrent: bool) -> dict[str, float]:
    """The database's own time for one claim and for one bare upsert
    (claim_floor.py), from a pass of claims of its own, not timed: the
    claims are recorded, then replayed on a copy taken before them."""
    async with open_store(url) as store:
        actions = await _claimable(store, claims)
        if store.engine.dialect.name == "sqlite":
            database = Path(str(make_url(url).database))
            copy = database.with_name(f"{database.stem}-floor.db")
            claim_floor.snapshot(database, copy)
            with _counting(store.engine) as counted, claim_floor.recording() as sent:
                await _claim_all(store, actions)
            _recorded(sent, claims, counted[0])
            return claim_floor.sqlite_seconds(copy, sent)
    # PostgreSQL copies a database only while nobody is connected to it.
    dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    await claim_floor.copy_database(dsn, FLOOR_COPY)
    try:
        async with open_store(url) as store:
            with _counting(store.engine) as counted, claim_floor.recording_postgresql() as pg_sent:
                await _claim_all(store, actions)
        _recorded(pg_sent, claims, counted[0])
        copy_dsn = dsn.rsplit("/", 1)[0] + f"/{FLOOR_COPY}"
        return await claim_floor.postgresql_seconds(copy_dsn, pg_sent, concurrent)
    finally:
        await claim_floor.drop_database(dsn, FLOOR_COPY)


FLOOR_COPY = "claim_floor_copy"


async def _claim_all(store: Any, actions: list[dict[str, Any]]) -> None:
    # One at a time, so each claim's statements are recorded together.
    for action in actions:
        claim = await store.claim_for_execution(action["id"], 30)
        if claim.outcome != ClaimOutcome.CLAIMED:
            raise RuntimeError(f"the floor's claim of {action['id']} was refused")


def _recorded(sent: list[Any], claims: int, statements: int) -> None:
    """The replay is the claims', or no floor: one transaction a claim, and
    every statement the engine's cursor events saw (BEGIN included on
    SQLite, as they count it), none twice."""
    if len(sent) != claims:
        raise RuntimeError(f"{len(sent)} transactions recorded for {claims} claims")
    recorded = sum(len(transaction) for transaction in sent)
    if recorded != statements:
        raise RuntimeError(f"{recorded} statements recorded, {statements} sent")


@contextmanager
def _counting(engine: Any) -> Iterator[list[int]]:
    """[statements, round trips] sent to the database while the block runs.

    Statements: SQLAlchemy's cursor events (every statement, BEGIN IMMEDIATE
    on SQLite included; on PostgreSQL asyncpg also sends BEGIN and COMMIT,
    which these do not see). Round trips: on SQLite, the driver's calls
    into SQLite (sqlite_driver.py: several statements may go in one, the
    commit goes in its own; each runs on the event loop while the
    connection's thread is idle, else on the thread); on PostgreSQL, each
    statement is one, asyncpg's BEGIN and COMMIT two more, and the pool's
    ping one where it sends one (not for a fresh connection, nor where the
    store's BEGIN carries it: pg_core.begun)."""
    seen = [0, 0]
    postgresql = engine.dialect.name == "postgresql"
    dialect = engine.sync_engine.dialect
    ping = dialect.do_ping

    def counted_ping(connection: Any) -> bool:
        if not PING_LEFT_TO_BEGIN.get():
            seen[1] += 1
        return ping(connection)

    def count(*_: Any) -> None:
        seen[0] += 1
        if postgresql:
            seen[1] += 1

    def begun(*_: Any) -> None:
        if postgresql:  # BEGIN and, later, COMMIT: two round trips the cursor events miss
            seen[1] += 2

    trip = OneTripConnection._execute

    async def counted_trip(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen[1] += 1
        return await trip(self, *args, **kwargs)

    event.listen(engine.sync_engine, "before_cursor_execute", count)
    event.listen(engine.sync_engine, "begin", begun)
    OneTripConnection._execute = counted_trip  # type: ignore[method-assign]
    if postgresql:
        dialect.do_ping = counted_ping
    try:
        yield seen
    finally:
        if postgresql:
            dialect.do_ping = ping
        OneTripConnection._execute = trip  # type: ignore[method-assign]
        event.remove(engine.sync_engine, "begin", begun)
        event.remove(engine.sync_engine, "before_cursor_execute", count)


CLAIMERS = 8  # concurrent claimers in the concurrent pass


async def _bounded(coroutines: list[Any], limit: int) -> None:
    gate = asyncio.Semaphore(limit)

    async def gated(c: Any) -> None:
        async with gate:
            await c

    await asyncio.gather(*(gated(c) for c in coroutines))


PASSES = 5  # store and baseline alternate, so the machine's noise falls on both
# Both sides' PostgreSQL pools keep a connection for each concurrent claimer:
# with SQLAlchemy's five kept, the three beyond are closed at each return to
# a full pool and opened again, a connection's cost inside the timed pass.
WARM_POOL = PoolSizing(size=CLAIMERS)


async def _compare(label: str, url: str, claims: int) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for concurrent in (False, True):
        mode = f"{CLAIMERS} concurrent" if concurrent else "sequential"
        taken: dict[str, list[tuple[float, float, float]]] = {"store": [], "baseline": []}
        async with contextlib.AsyncExitStack() as stack:
            # One engine a side for the mode's passes, as a worker keeps one
            # for its life, its pool holding a connection for each claimer.
            store = await stack.enter_async_context(open_store(url, pool=WARM_POOL))
            baseline = await stack.enter_async_context(open_store(url, pool=WARM_POOL))
            for _ in range(1 + PASSES):
                taken["store"].append(await _store_claims(store, claims, concurrent))
                taken["baseline"].append(await _baseline_claims(baseline, claims, concurrent))
        # The first pass of each side is on a fresh engine: it compiles the
        # statements, opens the connections and prepares the statements on
        # each, once a process or a connection (reported apart, "cold").
        cold_rate, cold_base = taken["store"].pop(0)[0], taken["baseline"].pop(0)[0]
        # The median warm pass of each side.
        store_rate, store_statements, store_trips = sorted(taken["store"])[PASSES // 2]
        base_rate, base_statements, base_trips = sorted(taken["baseline"])[PASSES // 2]
        print(
            f"{label:<11} {mode:<14} store {store_rate:8.0f}/s  baseline {base_rate:8.0f}/s"
            f"  ratio {store_rate / base_rate:5.2f}"
            f"  statements/claim store {store_statements:4.1f} baseline {base_statements:3.1f}"
            f"  round trips/claim store {store_trips:4.1f} baseline {base_trips:3.1f}"
            f"  (first pass, cold: {cold_rate:.0f}/s against {cold_base:.0f}/s,"
            f" {cold_rate / cold_base:.2f})"
        )
        figure = figures["concurrent" if concurrent else "sequential"] = {
            "store_claims_per_s": round(store_rate),
            "baseline_per_s": round(base_rate),
            "ratio": round(store_rate / base_rate, 2),
            "statements_per_claim": round(store_statements, 1),
            "baseline_statements": round(base_statements, 1),
            "round_trips_per_claim": round(store_trips, 1),
            "baseline_round_trips": round(base_trips, 1),
            "cold_store_claims_per_s": round(cold_rate),
            "cold_baseline_per_s": round(cold_base),
            "cold_ratio": round(cold_rate / cold_base, 2),
        }
        # SQLite's replay is sequential only: its write lock lets one claim
        # write at a time whoever sends them.
        if label == "postgresql" or not concurrent:
            try:
                replayed = await _replayed(url, claims, concurrent)
            except asyncpg.PostgresError as error:  # a server of the caller's: no copy allowed
                figure["floor"] = f"skipped: {error}"
                print(f"{label:<11} {mode:<14} floor skipped: {error}")
                continue
            floor = claim_floor.floor_ratio(base_rate, replayed)
            print(
                f"{label:<11} {mode:<14} floor ratio {floor:5.2f}  replayed alone: claim"
                f" {replayed['claim_s'] * 1e6:5.0f} µs, upsert {replayed['upsert_s'] * 1e6:4.0f} µs"
                f"  (baseline {1e6 / base_rate:4.0f} µs, store {1e6 / store_rate:4.0f} µs)"
            )
            figure["floor_ratio"] = round(floor, 2)
            figure["replayed_us_per_claim"] = round(replayed["claim_s"] * 1e6)
            figure["replayed_us_per_upsert"] = round(replayed["upsert_s"] * 1e6)
    return figures


async def measure(claims: int, postgresql: str | None = None) -> dict[str, Any]:
    """SQLite always; PostgreSQL at ``postgresql``, else a throwaway cluster
    when PostgreSQL is installed (else the figure says why it is missing)."""
    os.environ.setdefault(SECRET_ENV, "benchmark-only-secret-not-for-use")
    figures: dict[str, Any] = {"claims": claims}
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}"
        figures["sqlite"] = await _compare("sqlite", url, claims)
    if postgresql:
        figures["postgresql"] = await _compare("postgresql", postgresql, claims)
        return figures
    try:
        from tests.pg_cluster import PostgresUnavailable, start_cluster
    except ImportError:
        figures["postgresql"] = "skipped: run from the repository root for a throwaway cluster"
        return figures
    try:
        cluster = start_cluster()
    except PostgresUnavailable as exc:
        figures["postgresql"] = f"skipped: {exc}"
        return figures
    try:
        figures["postgresql"] = await _compare("postgresql", cluster.url(), claims)
    finally:
        cluster.stop()
    return figures


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--claims", type=int, default=300)
    parser.add_argument("--postgresql", help="postgresql+asyncpg:// URL (a database to use)")
    args = parser.parse_args()
    await measure(args.claims, args.postgresql)


if __name__ == "__main__":
    asyncio.run(main())
