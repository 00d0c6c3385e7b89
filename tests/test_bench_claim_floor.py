"""bench.claim_floor: a claim's floor is only honest if the replay does the
claim's whole work. Replayed on the copy taken before the claims, the
recorded statements must leave the copy as the claims left the store: each
action executing with its fencing token, its lease, its target's counter,
its audit event and its run's chain head; on SQLite and on PostgreSQL."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy import make_url

from bench import claim_floor
from bench.claims import _claim_all, _claimable, _counting
from roundtable.store import open_store

# What a claim writes, read back the same way from the store and the copy.
WRITTEN = [
    "SELECT id, status, fencing_token, attempt_count FROM actions ORDER BY id",
    "SELECT target_key, action_id, fencing_token FROM action_leases ORDER BY target_key",
    "SELECT target_key, last_token FROM target_fencing ORDER BY target_key",
    "SELECT run_id, seq, event_type, hash FROM audit_events ORDER BY run_id, seq",
    "SELECT id, last_event_seq, last_event_hash FROM runs ORDER BY id",
]


def _written(path: Path) -> list[list[tuple[object, ...]]]:
    connection = sqlite3.connect(path)
    try:
        return [connection.execute(query).fetchall() for query in WRITTEN]
    finally:
        connection.close()


async def test_the_replayed_claims_write_what_the_claims_wrote(tmp_path: Path) -> None:
    database, copy = tmp_path / "store.db", tmp_path / "copy.db"
    async with open_store(f"sqlite+aiosqlite:///{database}") as store:
        actions = await _claimable(store, 3)
        claim_floor.snapshot(database, copy)
        with _counting(store.engine) as counted, claim_floor.recording() as sent:
            await _claim_all(store, actions)  # each claimed, or it raises
    assert len(sent) == 3  # one transaction a claim, its BEGIN first
    assert all(statements[0] == ("begin", "BEGIN IMMEDIATE", None) for statements in sent)
    # Every statement sent is replayed, the read included (its time is the
    # claim's too, and the tables it leaves would not show it missing).
    assert sum(len(statements) for statements in sent) == counted[0] == 3 * 7

    before = _written(copy)
    claim_floor._replayed(copy, sent)
    after = _written(copy)
    assert after != before  # the replay wrote
    assert after == _written(database)  # and wrote what the claims did
    statuses = {status for _, status, _, _ in after[0]}
    assert statuses == {"executing"}


async def _written_postgresql(dsn: str) -> list[list[tuple[object, ...]]]:
    connection = await asyncpg.connect(dsn)
    try:
        return [[tuple(r) for r in await connection.fetch(query)] for query in WRITTEN]
    finally:
        await connection.close()


async def test_the_replayed_postgresql_claims_write_what_the_claims_did(postgres_url: str) -> None:
    dsn = make_url(postgres_url).set(drivername="postgresql").render_as_string(hide_password=False)
    copy = f"floor_{uuid.uuid4().hex[:12]}"
    copy_dsn = dsn.rsplit("/", 1)[0] + f"/{copy}"
    async with open_store(postgres_url) as store:
        actions = await _claimable(store, 3)
    await claim_floor.copy_database(dsn, copy)  # before the claims, nobody connected
    try:
        async with open_store(postgres_url) as store:
            with _counting(store.engine) as counted, claim_floor.recording_postgresql() as sent:
                await _claim_all(store, actions)  # each claimed, or it raises
        assert len(sent) == 3 and all(len(statements) == 2 for statements in sent)
        assert counted[0] == 3 * 2

        before = await _written_postgresql(copy_dsn)
        await claim_floor._replayed_postgresql(copy_dsn, sent, claimers=1)
        after = await _written_postgresql(copy_dsn)
        assert after != before  # the replay wrote
        assert after == await _written_postgresql(dsn)  # and wrote what the claims did
    finally:
        await claim_floor.drop_database(dsn, copy)


def test_the_floor_swaps_the_upserts_sqlite_time_for_the_claims() -> None:
    # A bare upsert of 400 µs, 40 of them SQLite's; a claim's statements 240 µs:
    # with no Python of its own the claim would take 600 µs, 400/600 of the rate.
    ratio = claim_floor.floor_ratio(2500, {"claim_s": 240e-6, "upsert_s": 40e-6})
    assert ratio == pytest.approx(400 / 600)
