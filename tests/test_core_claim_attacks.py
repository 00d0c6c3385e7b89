"""Attacks on the claim on a Core connection (``Database.core_transaction``)
and on an ``executing`` action settled in a second transaction
(``Leases._settle_executing``), from an adversarial review. Each test is
one attack; both databases unless the attack is specific to one. The split
itself is in the Spin model (proofs/lease.pml, ``settle_claim``)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import event, func, insert, select, text
from sqlalchemy.exc import IntegrityError

from roundtable.states import ClaimOutcome
from roundtable.store import NotFoundError, commit_notes, open_store
from roundtable.store.schema import (
    ActionLeaseRow,
    AuditEventRow,
    RunRow,
    TargetFencingRow,
    TargetScopeRow,
)
from tests.helpers import (
    FailOnce,
    listening,
    new_action,
    new_run,
    set_column,
    target_fields,
    target_for,
    two_writes_on_one_target,
)


def _pg(store: Any) -> bool:
    return store.engine.dialect.name == "postgresql"


@contextmanager
def statements(store: Any) -> Iterator[list[tuple[str, bool]]]:
    """Every statement sent, with whether this process's SQLite writer queue was held."""
    seen: list[tuple[str, bool]] = []
    writer = store.db._local_writer

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        seen.append((statement, writer.locked() if writer is not None else True))

    with listening(store.engine, "before_cursor_execute", record):
        yield seen


async def event_types(store: Any, run_id: str) -> list[str]:
    return [e["event_type"] for e in await store.list_events(run_id)]


async def lease_row(store: Any, action_id: str) -> ActionLeaseRow | None:
    async with store.session_factory() as session:
        return (
            await session.execute(
                select(ActionLeaseRow).where(ActionLeaseRow.action_id == action_id)
            )
        ).scalar_one_or_none()


async def lapse(store: Any, action_id: str) -> None:
    await set_column(
        store,
        ActionLeaseRow,
        ActionLeaseRow.action_id == action_id,
        lease_expires_at=datetime.now(UTC) - timedelta(seconds=5),
    )


async def counters(store: Any, action: dict[str, Any]) -> tuple[Any, Any]:
    """The target's and the scope's fencing counters."""
    async with store.session_factory() as session:
        target = (
            await session.execute(
                select(TargetFencingRow.last_token).where(
                    TargetFencingRow.target_key == action["target_key"]
                )
            )
        ).scalar_one_or_none()
        scope = (
            await session.execute(
                select(TargetScopeRow.claims).where(
                    TargetScopeRow.scope_key == action["target_scope"]
                )
            )
        ).scalar_one_or_none()
    return target, scope


def assert_pool_clean(store: Any) -> None:
    """No connection left out of the pool but the writers' held one and the
    readers' idle ones, each idle outside any transaction; the writer lock
    free."""
    held = store.db.writer_connection
    writer = [held.driver] if held is not None and held.driver is not None else []
    readers = store.db.reader_connections
    kept = readers.drivers if readers is not None else []
    assert store.engine.pool.checkedout() == len(writer + kept), store.engine.pool.status()
    for driver in writer:
        assert driver.known_idle and not driver._conn.in_transaction
    for driver in kept:  # a reader's may be fresh from the pool, not used yet
        assert readers.lendable(driver) and not driver._conn.in_transaction
    if store.db._local_writer is not None:
        assert not store.db._local_writer.locked()


@contextmanager
def between(store: Any, step: Any) -> Iterator[None]:
    """Run ``step`` between the claim's first transaction and its settling one."""
    leases = store.leases
    settle = leases._settle_executing

    async def in_the_gap(action_id: str) -> ClaimOutcome:
        await step(action_id)
        return await settle(action_id)

    leases._settle_executing = in_the_gap
    try:
        yield
    finally:
        leases._settle_executing = settle


# ------------------------------------------------- SQLite: the write lock


@pytest.fixture
async def sqlite_store(tmp_path) -> Any:
    async with open_store(f"sqlite+aiosqlite:///{tmp_path / 'claims.db'}") as store:
        yield store


async def test_sqlite_core_claim_begins_immediate_under_the_writer_queue(sqlite_store) -> None:
    store = sqlite_store
    """Attack: does ``engine.begin()`` still fire the engine's "begin" listener
    (BEGIN IMMEDIATE) and is every claim statement sent with this process's
    writer queue held? Also for the settling transaction."""
    run = await new_run(store)
    action = await new_action(store, run, key="imm", **target_fields("imm"))
    with statements(store) as seen:
        assert await store.claim_action_for_execution(action["id"], 30) == "claimed"
    assert seen[0][0] == "BEGIN IMMEDIATE", seen
    assert sum(1 for s, _ in seen if s.startswith("BEGIN")) == 1, seen
    assert all(held for _, held in seen), seen

    with statements(store) as seen:  # executing: two transactions now
        assert await store.claim_action_for_execution(action["id"], 30) == "in_progress"
    begins = [s for s, _ in seen if s.startswith("BEGIN")]
    assert begins == ["BEGIN IMMEDIATE", "BEGIN IMMEDIATE"], seen
    assert all(held for _, held in seen), seen
    assert_pool_clean(store)


async def test_sqlite_core_claim_waits_for_another_process_and_reads_after_it(
    sqlite_store,
) -> None:
    store = sqlite_store
    """Attack: a writer in another process holds SQLite's write lock and
    changes the action. A deferred BEGIN would read the stale 'approved' and
    then fail (SQLITE_BUSY_SNAPSHOT) or claim on stale facts; BEGIN IMMEDIATE
    waits, then reads what the other process committed."""
    run = await new_run(store)
    action = await new_action(store, run, key="xproc", **target_fields("xproc"))
    other = sqlite3.connect(store.engine.url.database, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute(
            "UPDATE actions SET status = 'waiting_approval' WHERE id = ?", (action["id"],)
        )
        claim = asyncio.ensure_future(store.claim_action_for_execution(action["id"], 30))
        await asyncio.sleep(0.5)
        assert not claim.done(), "the claim did not wait for the other process's write lock"
        other.execute("COMMIT")
        assert await asyncio.wait_for(claim, 30) == "not_approved"
    finally:
        other.close()
    assert await lease_row(store, action["id"]) is None
    assert_pool_clean(store)


async def test_sqlite_claim_is_three_trips_and_a_refusal_two(sqlite_store, trips) -> None:
    """The claim's writes wait for the action's move and go in its trip: BEGIN
    with the read, the writes, the commit (issue 12: every trip to SQLite's
    thread is a hand-off between threads). A refusal writes nothing: the read
    and the end of the transaction."""
    store = sqlite_store
    run = await new_run(store)
    first = await new_action(store, run, key="trip-1", **target_fields("trip"))
    second = await new_action(store, run, key="trip-2", **target_fields("trip"))
    await store.get_action(first["id"])  # the pool's connection opened and known idle
    with statements(store) as seen:
        trips.clear()
        claim = await store.claim_for_execution(first["id"], 30)
    assert claim.outcome == ClaimOutcome.CLAIMED and claim.action["fencing_token"] == 1
    assert len(trips) == 3, trips
    sent = [statement.split()[0] for statement, _ in seen]
    assert sent == ["BEGIN", "SELECT", "INSERT", "INSERT", "INSERT", "INSERT", "UPDATE", "UPDATE"]
    trips.clear()
    assert (await store.claim_for_execution(second["id"], 30)).outcome == "target_busy"
    assert len(trips) == 2, trips
    assert await store.verify_audit_chain(run["id"])
    assert_pool_clean(store)


async def test_sqlite_a_lease_the_claims_read_cannot_see_fails_it_and_nothing_stays(
    sqlite_store,
) -> None:
    """Attack: a lease of the key that the claim's read cannot see (its holder
    gone: another process wrote it with foreign keys off). The claim no longer
    waits for the lease's answer before its other writes, so the collision
    must fail the whole claim: the database's IntegrityError, and no token,
    no event, the action still approved, the orphan lease untouched."""
    store = sqlite_store
    run = await new_run(store)
    target = target_fields("orphaned")
    action = await new_action(store, run, key="orphaned", **target)
    events_before = await event_types(store, run["id"])
    await orphan_lease(store, action)
    with pytest.raises(IntegrityError):
        await store.claim_for_execution(action["id"], 30)
    assert (await store.get_action(action["id"]))["status"] == "approved"
    assert await counters(store, action) == (None, None)
    assert await event_types(store, run["id"]) == events_before
    assert await store.verify_audit_chain(run["id"])
    async with store.session_factory() as session:
        leases = await session.execute(
            select(ActionLeaseRow.action_id, ActionLeaseRow.fencing_token)
        )
        assert [tuple(lease) for lease in leases] == [("gone", 7)]
    assert_pool_clean(store)


async def orphan_lease(store: Any, action: dict[str, Any]) -> None:
    """A lease of ``action``'s key (token 7) whose holder the claim's read
    cannot see: another process wrote it with foreign keys off."""
    other = sqlite3.connect(store.engine.url.database, isolation_level=None)
    try:
        other.execute(
            "INSERT INTO action_leases (target_key, action_id, run_id, fencing_token,"
            " acquired_at, lease_expires_at, scope_key, namespace_wide)"
            " VALUES (?, 'gone', 'gone', 7, '2026-01-01 00:00:00', '2999-01-01 00:00:00', ?, 0)",
            (action["target_key"], action["target_scope"]),
        )
    finally:
        other.close()


# ------------------------------------------------- PostgreSQL: isolation


async def _repeatable_read_by_default(store: Any) -> None:
    """The database's own default (ALTER DATABASE … SET), not an option."""
    async with store.engine.connect() as conn:
        name = (await conn.execute(text("SELECT current_database()"))).scalar_one()
        await conn.execute(
            text(f"ALTER DATABASE \"{name}\" SET default_transaction_isolation = 'repeatable read'")
        )
        await conn.commit()
    await store.engine.dispose()  # new connections take the setting


@pytest.mark.parametrize("config", ["REPEATABLE READ", "SERIALIZABLE", "AUTOCOMMIT", "database"])
async def test_pg_claim_runs_at_read_committed_in_one_transaction_whatever_the_config(
    postgres_url, config: str
) -> None:
    """Attack: the engine (an execution option) or the database (its default)
    asks for a snapshot isolation, or for AUTOCOMMIT, under which the lock
    statement's locks would be gone before the check-and-write statement while
    ``current_setting('transaction_isolation')`` still said read committed.
    The claim pins READ COMMITTED on its own transaction: it claims (the
    in-SQL check would refuse anything else), and every one of its statements
    runs inside that one transaction."""
    async with open_store(postgres_url) as store:
        run = await new_run(store)
        action = await new_action(store, run, key="iso", **target_fields("iso"))
        if config == "database":
            await _repeatable_read_by_default(store)
        else:
            store.db.engine = store.engine.execution_options(isolation_level=config)
        seen: list[tuple[bool, Any]] = []

        def record(conn: Any, *_: Any) -> None:
            adapted = conn.connection.dbapi_connection
            seen.append((adapted.autocommit, conn.get_execution_options().get("isolation_level")))

        event.listen(store.engine.sync_engine, "before_cursor_execute", record)
        try:
            assert await store.claim_action_for_execution(action["id"], 30) == "claimed"
        finally:
            event.remove(store.engine.sync_engine, "before_cursor_execute", record)
        assert seen == [(False, "READ COMMITTED")] * 2, seen
        assert_pool_clean(store)


# ------------------------------------------------- the gap between the two transactions


async def test_gap_lapsed_lease_recovered_and_reconciled_in_between(store) -> None:
    """Attack: the claim finds its lapsed attempt executing; before it settles,
    recovery makes it unknown and an operator reconciles it failed (the lease
    is deleted, the target freed). The settle must not mark it unknown again,
    write a second unknown event, re-lease, or hand anything out."""
    run = await new_run(store)
    action = await new_action(store, run, key="gap-rec", **target_fields("gap-rec"))
    assert await store.claim_action_for_execution(action["id"], 30) == "claimed"
    await lapse(store, action["id"])

    async def recovered_and_reconciled(action_id: str) -> None:
        assert [a["id"] for a in await store.recover_expired_action_leases()] == [action_id]
        await store.reconcile_action(action_id, "failed", "operator")

    with between(store, recovered_and_reconciled):
        claim = await store.claim_for_execution(action["id"], 30)
    assert claim.outcome == ClaimOutcome.ALREADY_FINISHED
    assert claim.action is None and claim.sealed_arguments is None
    after = await store.get_action(action["id"])
    assert after["status"] == "failed" and after["attempt_count"] == 1
    assert await lease_row(store, action["id"]) is None
    types = await event_types(store, run["id"])
    assert types.count("action.executing") == 1
    assert types.count("action.unknown") == 1
    assert types.count("action.reconciled") == 1
    assert await store.verify_audit_chain(run["id"])
    assert_pool_clean(store)


async def test_gap_live_lease_lapses_in_between_becomes_unknown_and_blocks(store) -> None:
    """Attack: the lease is live when the claim reads the action and lapses
    before it settles. The settle must judge by its own clock: unknown, the
    lease row kept, the target blocked until reconciled."""
    run = await new_run(store)
    target = target_fields("gap-lapse")
    action = await new_action(store, run, key="gap-lapse", **target)
    assert await store.claim_action_for_execution(action["id"], 30) == "claimed"
    token = (await store.get_action(action["id"]))["fencing_token"]

    async def lapses(action_id: str) -> None:
        await lapse(store, action_id)
        # The attempt's keeper tries to hold: a lapsed lease is not held.
        assert await store.hold_action_lease(action_id, token, 30) is None

    with between(store, lapses):
        assert await store.claim_action_for_execution(action["id"], 30) == "unknown"
    after = await store.get_action(action["id"])
    assert after["status"] == "unknown"
    assert after["result"]["error_code"] == "target_lease_expired_during_execution"
    assert await lease_row(store, action["id"]) is not None
    successor = await new_action(store, run, key="gap-lapse-2", **target)
    assert await store.claim_action_for_execution(successor["id"], 30) == (
        "target_reconciliation_required"
    )
    assert (await event_types(store, run["id"])).count("action.unknown") == 1
    assert await store.verify_audit_chain(run["id"])


async def test_gap_lapsed_lease_renewed_in_between_is_impossible(store) -> None:
    """Attack: a lapsed lease found by the claim, then a renewal slips into
    the gap: renew/hold refuse a lapsed lease, so the settle still sees it
    lapsed and makes it unknown (never in_progress on a lease revived)."""
    run = await new_run(store)
    action = await new_action(store, run, key="gap-renew", **target_fields("gap-renew"))
    assert await store.claim_action_for_execution(action["id"], 30) == "claimed"
    token = (await store.get_action(action["id"]))["fencing_token"]
    await lapse(store, action["id"])

    async def renews(action_id: str) -> None:
        assert not await store.renew_action_lease(action_id, token, 30)
        assert await store.hold_action_lease(action_id, token, 30) is None

    with between(store, renews):
        assert await store.claim_action_for_execution(action["id"], 30) == "unknown"


async def test_gap_run_closed_in_between(store) -> None:
    """Attack: the run's workflow closes between the two transactions
    (settle_closed makes the action unknown). The claim answers unknown and
    leaves the closer's error code; one unknown event."""
    run = await new_run(store)
    action = await new_action(store, run, key="gap-close", **target_fields("gap-close"))
    assert await store.claim_action_for_execution(action["id"], 30) == "claimed"

    async def closed(_action_id: str) -> None:
        settled = await store.settle_closed_run(run["id"], "terminated")
        assert settled["unknown_actions"] == [action["id"]]

    with between(store, closed):
        assert await store.claim_action_for_execution(action["id"], 30) == "unknown"
    after = await store.get_action(action["id"])
    assert after["result"]["error_code"] == "workflow_closed_during_execution"
    assert (await event_types(store, run["id"])).count("action.unknown") == 1
    assert await store.verify_audit_chain(run["id"])


async def test_gap_result_then_successor_claims_the_target_in_between(store) -> None:
    """Attack: between the transactions the attempt records success (the lease
    is deleted) and a successor claims the same target. The first claim must
    answer already_finished and touch neither the successor's lease nor its
    token; tokens keep rising."""
    run = await new_run(store)
    target = target_fields("gap-succ")
    first = await new_action(store, run, key="gap-succ-1", **target)
    second = await new_action(store, run, key="gap-succ-2", **target)
    assert await store.claim_action_for_execution(first["id"], 30) == "claimed"
    token = (await store.get_action(first["id"]))["fencing_token"]

    async def result_and_successor(action_id: str) -> None:
        assert await store.record_action_terminal_result(
            action_id, "succeeded", {}, fencing_token=token
        )
        assert await store.claim_action_for_execution(second["id"], 30) == "claimed"

    with between(store, result_and_successor):
        assert await store.claim_action_for_execution(first["id"], 30) == "already_finished"
    held = await lease_row(store, second["id"])
    successor = await store.get_action(second["id"])
    assert held is not None and held.fencing_token == successor["fencing_token"] > token
    assert successor["status"] == "executing"
    assert (await store.get_action(first["id"]))["status"] == "succeeded"
    assert await store.verify_audit_chain(run["id"])


async def test_live_attempt_found_twice_writes_nothing(store) -> None:
    """Attack: a redelivered claim of a live attempt must write nothing in
    either transaction (no event, no token, no lease change)."""
    run = await new_run(store)
    action = await new_action(store, run, key="live", **target_fields("live"))
    assert await store.claim_action_for_execution(action["id"], 30) == "claimed"
    before = await store.get_action(action["id"])
    lease_before = await lease_row(store, action["id"])
    events_before = await event_types(store, run["id"])
    counters_before = await counters(store, action)
    for _ in range(3):
        assert await store.claim_action_for_execution(action["id"], 30) == "in_progress"
    assert await counters(store, action) == counters_before
    assert await store.get_action(action["id"]) == before
    lease_after = await lease_row(store, action["id"])
    assert (lease_after.fencing_token, lease_after.lease_expires_at) == (
        lease_before.fencing_token,
        lease_before.lease_expires_at,
    )
    assert await event_types(store, run["id"]) == events_before


async def test_many_claims_of_a_lapsed_attempt_racing_recovery_mark_unknown_once(store) -> None:
    """Attack: ten redelivered claims of one lapsed attempt and two recovery
    sweeps race through the gap. Exactly one unknown: one event, one
    ActionEnded note told to the metrics, every claim answers unknown."""
    run = await new_run(store)
    action = await new_action(store, run, key="herd", **target_fields("herd"))
    assert await store.claim_action_for_execution(action["id"], 30) == "claimed"
    await lapse(store, action["id"])
    told: list[Any] = []
    store.db.observers.append(told.extend)
    answers = await asyncio.gather(
        *(store.claim_action_for_execution(action["id"], 30) for _ in range(10)),
        store.recover_expired_action_leases(),
        store.recover_expired_action_leases(),
    )
    assert set(answers[:10]) == {"unknown"}, answers
    ended = [n for n in told if isinstance(n, commit_notes.ActionEnded)]
    assert ended == [commit_notes.ActionEnded("controlled_write", "unknown")], told
    assert (await event_types(store, run["id"])).count("action.unknown") == 1
    assert await store.verify_audit_chain(run["id"])
    assert_pool_clean(store)


async def test_redelivered_claims_racing_the_result_never_claim_twice(store) -> None:
    """Attack without injection: twenty redelivered claims of an executing
    action race its own result. Every answer is in_progress or
    already_finished; the result stands; one attempt; no unknown."""
    run = await new_run(store)
    action = await new_action(store, run, key="race-res", **target_fields("race-res"))
    assert await store.claim_action_for_execution(action["id"], 30) == "claimed"
    token = (await store.get_action(action["id"]))["fencing_token"]
    claims = [store.claim_action_for_execution(action["id"], 30) for _ in range(20)]
    result = store.record_action_terminal_result(
        action["id"], "succeeded", {"ok": 1}, fencing_token=token
    )
    answers = await asyncio.gather(*claims[:10], result, *claims[10:])
    assert answers[10] is True
    outcomes = answers[:10] + answers[11:]
    assert set(outcomes) <= {"in_progress", "already_finished"}, outcomes
    after = await store.get_action(action["id"])
    assert after["status"] == "succeeded" and after["result"] == {"ok": 1}
    assert after["attempt_count"] == 1
    types = await event_types(store, run["id"])
    assert "action.unknown" not in types and types.count("action.executing") == 1
    assert await lease_row(store, action["id"]) is None
    assert await store.verify_audit_chain(run["id"])
    assert_pool_clean(store)


# ------------------------------------------------- notes


async def holder_and_waiter(store: Any, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two writes of one run on one target; the first claimed."""
    _, holder, waiter = await two_writes_on_one_target(store, name)
    assert await store.claim_action_for_execution(holder["id"], 30) == "claimed"
    return holder, waiter


async def test_busy_claim_tells_lease_busy_once_after_commit(store) -> None:
    _, waiter = await holder_and_waiter(store, "busy")
    told: list[list[Any]] = []
    committed: list[bool] = []
    writer = store.db._local_writer

    def observer(notes: Any) -> None:
        told.append(list(notes))
        # Told after the transaction ended: the writer queue is free again.
        committed.append(writer is None or not writer.locked())

    store.db.observers.append(observer)
    assert await store.claim_action_for_execution(waiter["id"], 30) == "target_busy"
    assert told == [[commit_notes.LeaseBusy("controlled_write")]]
    assert committed == [True]


async def test_blocked_claim_tells_lease_busy_and_the_unknown_once(store) -> None:
    """A claim blocked by an unknown write on its target tells LeaseBusy once;
    the claim that made the lapsed attempt unknown (second transaction) tells
    ActionEnded(unknown) once; an in_progress claim tells nothing."""
    holder, waiter = await holder_and_waiter(store, "blocked")
    told: list[list[Any]] = []
    store.db.observers.append(lambda notes: told.append(list(notes)))
    assert await store.claim_action_for_execution(holder["id"], 30) == "in_progress"
    assert told == []
    await lapse(store, holder["id"])
    assert await store.claim_action_for_execution(holder["id"], 30) == "unknown"
    assert told == [[commit_notes.ActionEnded("controlled_write", "unknown")]]
    told.clear()
    assert await store.claim_action_for_execution(waiter["id"], 30) == (
        "target_reconciliation_required"
    )
    assert told == [[commit_notes.LeaseBusy("controlled_write")]]


async def test_busy_claim_whose_commit_fails_tells_nothing_and_leaks_nothing(store) -> None:
    """Attack: the claim's commit fails (a database error at COMMIT). Its
    LeaseBusy note must be dropped, the error surfaced, the connection
    returned, the writer queue released, and the next claim must work."""
    _, waiter = await holder_and_waiter(store, "busy-fail")
    told: list[Any] = []
    store.db.observers.append(told.append)

    class CommitFailed(Exception):
        pass

    fail_commit = FailOnce(CommitFailed("injected at COMMIT"))

    with listening(store.engine, "commit", fail_commit), pytest.raises(CommitFailed):
        await store.claim_action_for_execution(waiter["id"], 30)
    assert told == []
    assert_pool_clean(store)
    assert await store.claim_action_for_execution(waiter["id"], 30) == "target_busy"
    assert told == [[commit_notes.LeaseBusy("controlled_write")]]


# ------------------------------------------------- errors, leaks, cancellation


async def test_not_found_surfaces_and_releases_everything(store) -> None:
    for _ in range(3):
        with pytest.raises(NotFoundError, match="not found"):
            await store.claim_for_execution("no-such-action", 30)
    assert_pool_clean(store)
    run = await new_run(store)
    action = await new_action(store, run, key="after-nf", **target_fields("after-nf"))
    assert await store.claim_action_for_execution(action["id"], 30) == "claimed"


async def test_database_error_mid_claim_rolls_back_every_write(store) -> None:
    """Attack: the claim's audit event collides with an event already at the
    next seq (a database error after the lease, counter and action writes on
    SQLite; inside the CTE on PostgreSQL). The error surfaces as the database's
    and nothing of the claim stays: no lease, no token, still approved."""
    run = await new_run(store)
    target = target_fields("boom")
    action = await new_action(store, run, key="boom", **target)
    async with store.session_factory() as session, session.begin():
        head = await session.get(RunRow, run["id"])
        await session.execute(
            insert(AuditEventRow).values(
                run_id=run["id"],
                seq=head.last_event_seq + 1,
                event_type="test.squatter",
                payload={},
                prev_hash=head.last_event_hash,
                hash="0" * 64,
                created_at=datetime.now(UTC),
            )
        )
    told: list[Any] = []
    store.db.observers.append(told.append)
    with pytest.raises(IntegrityError):
        await store.claim_for_execution(action["id"], 30)
    assert (await store.get_action(action["id"]))["status"] == "approved"
    assert await lease_row(store, action["id"]) is None
    async with store.session_factory() as session:
        tokens = (
            await session.execute(
                select(func.max(TargetFencingRow.last_token)).where(
                    TargetFencingRow.target_key == target["target_key"]
                )
            )
        ).scalar_one_or_none()
    assert not tokens  # absent (SQLite) or left at 0 (PostgreSQL's lock upsert)
    assert told == []
    assert_pool_clean(store)


async def test_claims_of_every_outcome_leak_no_connection(store) -> None:
    run = await new_run(store)
    target = target_for("leak")
    actions = [await new_action(store, run, key=f"leak-{i}", target_key=target) for i in range(4)]
    waiting = await new_action(
        store, run, key="leak-w", target_key=target_for("leak-w"), status="waiting_approval"
    )
    answers = []
    for _ in range(5):
        for action in (*actions, waiting):
            answers.append(await store.claim_action_for_execution(action["id"], 30))
    assert {"claimed", "in_progress", "target_busy", "not_approved"} <= set(answers)
    assert_pool_clean(store)


async def test_cancelled_claim_waiting_for_a_lock_completes_and_releases(store) -> None:
    """Attack: the caller is cancelled while the claim waits for the run's lock
    (PostgreSQL: another transaction holds the run row; SQLite: another
    process holds the write lock). The claim runs to its end (to_completion),
    the caller sees CancelledError, what it wrote is whole, nothing leaks."""
    run = await new_run(store)
    action = await new_action(store, run, key="cancel", **target_fields("cancel"))
    if _pg(store):
        blocker = await store.engine.connect()
        await blocker.execute(
            text("SELECT id FROM runs WHERE id = :id FOR UPDATE"), {"id": run["id"]}
        )
        release = blocker.rollback
    else:
        raw = sqlite3.connect(store.engine.url.database, isolation_level=None)
        raw.execute("BEGIN IMMEDIATE")

        async def release() -> None:
            raw.execute("ROLLBACK")

    claim = asyncio.ensure_future(store.claim_for_execution(action["id"], 30))
    await asyncio.sleep(0.5)
    assert not claim.done()
    claim.cancel()
    await asyncio.sleep(0.1)
    await release()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(claim, 30)
    if _pg(store):
        await blocker.close()
    else:
        raw.close()
    after = await store.get_action(action["id"])
    assert after["status"] == "executing"
    held = await lease_row(store, action["id"])
    assert held is not None and held.fencing_token == after["fencing_token"]
    assert (await event_types(store, run["id"])).count("action.executing") == 1
    assert await store.verify_audit_chain(run["id"])
    assert_pool_clean(store)


async def test_settling_needs_no_second_connection_at_once(database_url, monkeypatch) -> None:
    """Attack: a pool of one connection. If the settling transaction were
    opened while the claim's Core connection is still checked out (nested),
    a redelivered claim would wait for itself until the pool timed out."""
    import functools

    from roundtable.store import engine as engine_module

    monkeypatch.setattr(
        engine_module,
        "create_async_engine",
        functools.partial(
            engine_module.create_async_engine, pool_size=1, max_overflow=0, pool_timeout=5
        ),
    )
    async with open_store(database_url) as store:
        run = await new_run(store)
        action = await new_action(store, run, key="pool1", **target_fields("pool1"))
        assert await store.claim_action_for_execution(action["id"], 30) == "claimed"
        answers = await asyncio.wait_for(
            asyncio.gather(*(store.claim_action_for_execution(action["id"], 30) for _ in range(5))),
            60,
        )
        assert set(answers) == {"in_progress"}
        await lapse(store, action["id"])
        assert await store.claim_action_for_execution(action["id"], 30) == "unknown"
        assert_pool_clean(store)
