"""PostgreSQL's connection pool, sized by the operator
(``ROUNDTABLE_DATABASE_POOL_SIZE``, ``…_MAX_OVERFLOW``,
``…_POOL_TIMEOUT_SECONDS``; README, "The database pool").

What a small pool must not break: no path of the store, the worker or the
API holds one pooled connection while it waits for another, or a process
with one connection would stall until the pool's timeout. So a whole run,
decided through the HTTP API, and many claimers racing on overlapping
targets, run on a pool of exactly one connection that never overflows,
with a checkout timeout short enough to fail the test were anything to
wait for a second connection."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from roundtable.cli.shared import store_from
from roundtable.config import PoolSizing, Settings
from roundtable.store import open_store
from roundtable.store.engine import create_engine_for
from tests.api_server import serve_api
from tests.test_claim_cut import (
    test_many_claimers_on_overlapping_targets_never_overlap_and_tokens_rise as claimers_race,
)
from tests.workflow_harness import harness, script, ticket_call

# One connection, no overflow; a checkout waits at most this long, so a
# path that needs a second connection while it holds one fails the test.
ONE = PoolSizing(size=1, overflow=0, timeout_seconds=10.0)


def test_the_pool_settings_are_read_and_bad_ones_refused_by_name(monkeypatch) -> None:
    monkeypatch.setenv("ROUNDTABLE_DATABASE_POOL_SIZE", "12")
    monkeypatch.setenv("ROUNDTABLE_DATABASE_MAX_OVERFLOW", "0")
    monkeypatch.setenv("ROUNDTABLE_DATABASE_POOL_TIMEOUT_SECONDS", "2.5")
    assert Settings().database_pool() == PoolSizing(12, 0, 2.5)
    assert Settings().database_pool().engine_options() == {
        "pool_size": 12,
        "max_overflow": 0,
        "pool_timeout": 2.5,
    }
    for name in ("POOL_SIZE", "MAX_OVERFLOW", "POOL_TIMEOUT_SECONDS"):
        monkeypatch.delenv(f"ROUNDTABLE_DATABASE_{name}")
    assert Settings().database_pool() == PoolSizing()
    assert PoolSizing().engine_options() == {}  # SQLAlchemy's own sizes

    # Empty in an env file means unset, as for the other optional settings.
    monkeypatch.setenv("ROUNDTABLE_DATABASE_POOL_SIZE", "")
    assert Settings().database_pool().size is None
    for name, value in (
        ("POOL_SIZE", "0"),  # a pool that can lend nothing
        ("POOL_SIZE", "-5"),
        ("POOL_SIZE", "many"),
        ("MAX_OVERFLOW", "-1"),  # SQLAlchemy's "no limit": not allowed here
        ("POOL_TIMEOUT_SECONDS", "0"),
        ("POOL_TIMEOUT_SECONDS", "1e-320"),  # no wait at all, in effect
        ("POOL_TIMEOUT_SECONDS", "0.05"),
        ("POOL_TIMEOUT_SECONDS", "nan"),
    ):
        variable = f"ROUNDTABLE_DATABASE_{name}"
        monkeypatch.setenv(variable, value)
        with pytest.raises(ValidationError) as refused:
            Settings()
        assert f"database_{name.lower()}" in str(refused.value), (variable, value)
        monkeypatch.delenv(variable)


async def test_postgresql_takes_the_sizes_and_sqlite_keeps_its_own(postgres_url, tmp_path) -> None:
    engine = create_engine_for(postgres_url, PoolSizing(size=3, overflow=2, timeout_seconds=4.0))
    try:
        pool = engine.pool
        assert (pool.size(), pool._max_overflow, pool._timeout) == (3, 2, 4.0)  # type: ignore[attr-defined]
    finally:
        await engine.dispose()
    # SQLite's writers share one held connection, and its pool's sizes were
    # measured for it (bench/README): a PostgreSQL setting leaves it alone.
    sqlite = create_engine_for(f"sqlite+aiosqlite:///{tmp_path / 'x.db'}", ONE)
    try:
        assert sqlite.pool.size() == 5  # type: ignore[attr-defined]
    finally:
        await sqlite.dispose()


async def test_the_clis_store_takes_the_settings_pool(postgres_url, monkeypatch) -> None:
    """The CLI's commands that go to the database directly open it with the
    settings' URL, and must take their pool with it."""
    async with open_store(postgres_url):  # the schema, as the worker leaves it
        pass
    monkeypatch.setenv("ROUNDTABLE_DATABASE_URL", postgres_url)
    monkeypatch.setenv("ROUNDTABLE_DATABASE_POOL_SIZE", "1")
    monkeypatch.setenv("ROUNDTABLE_DATABASE_MAX_OVERFLOW", "0")
    async with store_from(Settings()) as store:
        pool = store.engine.pool
        assert (pool.size(), pool._max_overflow) == (1, 0)  # type: ignore[attr-defined]


async def test_open_store_without_a_url_takes_the_settings_pool(postgres_url, monkeypatch) -> None:
    monkeypatch.setenv("ROUNDTABLE_DATABASE_URL", postgres_url)
    monkeypatch.setenv("ROUNDTABLE_DATABASE_POOL_SIZE", "2")
    monkeypatch.setenv("ROUNDTABLE_DATABASE_MAX_OVERFLOW", "1")
    async with open_store() as store:
        assert store.engine.pool.size() == 2  # type: ignore[attr-defined]
        assert store.engine.pool._max_overflow == 1  # type: ignore[attr-defined]


@pytest.mark.timeout(300)
async def test_a_run_decided_through_the_api_runs_on_one_connection(tmp_path, postgres_url) -> None:
    """Two seats write one ticket, each write approved through the API by
    its owner: the worker's run, its local activities and writes, and the
    API's decisions, all on a pool of one connection."""
    calls = script(
        ("seat-1", 1, [ticket_call("ticket_update", "T-1", fields={"owner": "a"})]),
        ("seat-2", 1, [ticket_call("ticket_close", "T-1")]),
    )
    async with (
        harness(tmp_path, database_url=postgres_url, pool=ONE) as h,
        serve_api(h) as api,
    ):
        assert h.store.engine.pool.size() == 1  # type: ignore[attr-defined]
        started = await api.http.post(
            "/v1/runs",
            json={"task_text": "t", "script": calls, "mode": "parallel"},
            headers=api.auth("alice"),
        )
        assert started.status_code in (200, 201, 202), started.text
        handle = h.client.get_workflow_handle(started.json()["run_id"])
        decided: set[str] = set()
        while len(decided) < 2:
            state = await h.wait_for(handle, lambda s: bool(set(s.pending_approvals) - decided))
            for approval_id in sorted(set(state.pending_approvals) - decided):
                path = f"/v1/approvals/{approval_id}"
                shown = (await api.http.get(path, headers=api.auth("alice"))).json()
                answer = await api.http.post(
                    f"{path}/decision",
                    headers=api.auth("alice"),
                    json={"decision": "approved", "arguments_digest": shown["arguments_digest"]},
                )
                assert answer.status_code == 200, answer.text
                decided.add(approval_id)
        assert (await h.result(handle))["status"] == "completed"
        actions = await h.store.list_actions(handle.id)
        assert sorted(a["status"] for a in actions) == ["succeeded", "succeeded"]
        assert sorted(a["fencing_token"] for a in actions) == [1, 2]
        log = await h.tickets.write_log()
        assert sorted(w["operation"] for w in log) == ["close", "update"]
        assert await h.store.verify_audit_chain(handle.id)


@pytest.mark.timeout(600)
async def test_claimers_racing_on_overlapping_targets_share_one_connection(postgres_url) -> None:
    """The claim race of tests/test_claim_cut.py (every waiting write claims
    at once while the last round's holders record their results) with one
    connection for them all: they queue for it, and the race's promises
    hold (never two live leases on overlapping targets, rising tokens)."""
    async with open_store(postgres_url, pool=ONE) as store:
        assert store.engine.pool.size() == 1  # type: ignore[attr-defined]
        await claimers_race(store)
