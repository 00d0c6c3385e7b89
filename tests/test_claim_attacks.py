"""Adversarial review of the two-statement claim (issue 12), on both
databases: the order the claim takes its locks in (PostgreSQL, checked with
pg_stat_activity and NOWAIT probes, not by hoping for a schedule), the run's
audit chain when another writer moved its head while the claim waited, the
clock read after the locks, an expired lease of another action, keys that
look like SQL, the claim's outcomes for actions that are not ``approved``,
and a claim racing the code that settles a closed run."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import DBAPIError

from roundtable.store import ClaimOutcome, NotFoundError
from roundtable.store.schema import ActionLeaseRow, ActionRow, AuditEventRow
from tests.helpers import new_action, new_run, target_fields

WIDE = None


def _pg(store: Any) -> bool:
    return store.engine.dialect.name == "postgresql"


async def _blocked_on_locks(store: Any, count: int, patience: float = 10) -> None:
    """Wait until ``count`` sessions of this database wait for a lock."""
    deadline = asyncio.get_running_loop().time() + patience
    async with store.engine.connect() as conn:
        while True:
            waiting = (
                await conn.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                    )
                )
            ).scalar_one()
            await conn.rollback()
            if waiting >= count:
                return
            assert asyncio.get_running_loop().time() < deadline, "nobody waits for the lock"
            await asyncio.sleep(0.02)


async def _lockable(store: Any, sql: str, **params: Any) -> bool:
    """Whether another session could lock these rows right now (NOWAIT)."""
    async with store.engine.connect() as conn:
        try:
            await conn.execute(text(sql + " FOR UPDATE NOWAIT"), params)
            return True
        except DBAPIError as exc:
            assert "lock" in str(exc).lower(), exc
            return False
        finally:
            await conn.rollback()


async def _used_before(store: Any, run: dict[str, Any], key: str, **fields: Any) -> None:
    """Claim and release once, so the key's and scope's counter rows exist."""
    before = await new_action(store, run, key=key, **fields)
    assert await store.claim_action_for_execution(before["id"], 30) == "claimed"
    assert await store.record_action_terminal_result(before["id"], "succeeded", {})


# ------------------------------------------------------------ lock order


@pytest.mark.parametrize("held", ["scope", "target"])
async def test_a_claim_locks_its_run_then_scope_then_target(store, held) -> None:
    """PostgreSQL: with the scope's counter held elsewhere, a claim waits
    holding its run and not yet the target's counter; with the target's
    counter held, it waits holding its run and the scope. (Any other order
    could deadlock against a claim of an overlapping target.) SQLite: a
    claim waits behind another writer and then claims."""
    runs = [await new_run(store) for _ in range(2)]
    fields = target_fields("ordered", namespace="order")
    await _used_before(store, runs[0], "before", **fields)
    action = await new_action(store, runs[1], key="claimer", **fields)
    scope_sql = "SELECT 1 FROM target_scopes WHERE scope_key = :k"
    target_sql = "SELECT 1 FROM target_fencing WHERE target_key = :k"
    run_sql = "SELECT 1 FROM runs WHERE id = :k"

    if not _pg(store):
        async with store.db.transaction() as session:
            await session.execute(text("UPDATE runs SET updated_at = updated_at"))
            task = asyncio.create_task(store.claim_action_for_execution(action["id"], 30))
            done, _ = await asyncio.wait([task], timeout=0.3)
            assert not done
        assert await task == "claimed"
        return

    holder = await store.engine.connect()
    try:
        sql, key = (
            (scope_sql, fields["target_scope"])
            if held == "scope"
            else (target_sql, fields["target_key"])
        )
        await holder.execute(text(sql + " FOR UPDATE"), {"k": key})
        task = asyncio.create_task(store.claim_action_for_execution(action["id"], 30))
        await _blocked_on_locks(store, 1)
        assert not await _lockable(store, run_sql, k=runs[1]["id"])
        if held == "scope":
            assert await _lockable(store, target_sql, k=fields["target_key"])
        else:
            assert not await _lockable(store, scope_sql, k=fields["target_scope"])
        assert not task.done()
    finally:
        await holder.rollback()
        await holder.close()
    assert await task == "claimed"


async def test_claims_of_a_wide_and_a_specific_target_cross_without_deadlock(store) -> None:
    """A wide claim and a specific claim of one scope, each from a run the
    other's run holds no lock on, started while both counters are held: one
    claims, the other is busy, nobody deadlocks (PostgreSQL would abort one
    with a deadlock error)."""
    runs = [await new_run(store) for _ in range(3)]
    specific = target_fields("crossed", namespace="cross")
    wide = target_fields(WIDE, namespace="cross")
    await _used_before(store, runs[0], "before-specific", **specific)
    await _used_before(store, runs[0], "before-wide", **wide)
    one = await new_action(store, runs[1], key="specific", **specific)
    other = await new_action(store, runs[2], key="wide", **wide)
    if _pg(store):
        holder = await store.engine.connect()
        await holder.execute(
            text("SELECT 1 FROM target_fencing WHERE target_key IN (:a, :b) FOR UPDATE"),
            {"a": specific["target_key"], "b": wide["target_key"]},
        )
        tasks = [
            asyncio.create_task(store.claim_action_for_execution(a["id"], 30)) for a in (one, other)
        ]
        await _blocked_on_locks(store, 2)
        await holder.rollback()
        await holder.close()
    else:
        tasks = [
            asyncio.create_task(store.claim_action_for_execution(a["id"], 30)) for a in (one, other)
        ]
    assert sorted(await asyncio.gather(*tasks)) == ["claimed", "target_busy"]


# ------------------------------------------------------------ audit chain


async def test_two_claims_of_one_run_chain_on_the_head_another_writer_moved(store) -> None:
    """Two writes of one run claim while another transaction holds the run
    and appends to its log: both wait, then chain on the head as committed
    (not as their snapshots had it)."""
    run = await new_run(store)
    first = await new_action(store, run, key="one", **target_fields("one"))
    second = await new_action(store, run, key="two", **target_fields("two"))
    async with store.db.transaction() as session:
        locked = await store.db.lock_run(session, run["id"])
        tasks = [
            asyncio.create_task(store.claim_action_for_execution(a["id"], 30))
            for a in (first, second)
        ]
        if _pg(store):
            await _blocked_on_locks(store, 2)
        else:
            await asyncio.sleep(0.2)
        assert not any(t.done() for t in tasks)
        for n in range(3):
            await store.db.audit(session, locked, "test.moved_head", {"n": n}, datetime.now(UTC))
    assert await asyncio.gather(*tasks) == ["claimed", "claimed"]
    assert await store.verify_audit_chain(run["id"])
    async with store.session_factory() as session:
        events = (
            await session.execute(
                select(AuditEventRow.seq, AuditEventRow.event_type)
                .where(AuditEventRow.run_id == run["id"])
                .order_by(AuditEventRow.seq)
            )
        ).all()
    assert [e[0] for e in events] == list(range(1, len(events) + 1))
    assert [e[1] for e in events][-5:] == ["test.moved_head"] * 3 + ["action.executing"] * 2


# ------------------------------------------------------------ clock


async def test_the_lease_runs_from_after_the_locks_were_waited_for(store) -> None:
    """The lease's start is read after the claim's locks: a claim that waited
    for a second does not get a lease a second short (nor one that started
    in the past). Its length is exactly what was asked."""
    runs = [await new_run(store) for _ in range(2)]
    fields = target_fields("clocked", namespace="clock")
    await _used_before(store, runs[0], "before", **fields)
    action = await new_action(store, runs[1], key="clocked", **fields)
    async with store.db.transaction() as session:
        if _pg(store):
            await session.execute(
                text("SELECT 1 FROM target_fencing WHERE target_key = :k FOR UPDATE"),
                {"k": fields["target_key"]},
            )
        task = asyncio.create_task(store.claim_for_execution(action["id"], 30))
        if _pg(store):
            await _blocked_on_locks(store, 1)
        await asyncio.sleep(1.0)
        released = datetime.now(UTC)
    claim = await task
    assert claim.outcome == "claimed"
    async with store.session_factory() as session:
        lease = (
            await session.execute(
                select(ActionLeaseRow).where(ActionLeaseRow.action_id == action["id"])
            )
        ).scalar_one()
    acquired = lease.acquired_at.astimezone(UTC)
    # Read before the wait, it would be a second before the release.
    assert (released - acquired).total_seconds() < 0.5, (released, acquired)
    assert (lease.lease_expires_at - lease.acquired_at).total_seconds() == 30
    assert claim.action["started_at"] == lease.acquired_at


# ------------------------------------------------------------ expired leases


async def test_an_expired_lease_of_another_action_keeps_its_target_taken(store) -> None:
    """A lease that ran out is never taken over by a claim: the target stays
    busy until recovery makes its action unknown (then reconciliation is
    required), and only a reconciliation frees it, for a higher token."""
    runs = [await new_run(store) for _ in range(2)]
    fields = target_fields("lapsed", namespace="lapse")
    holder = await new_action(store, runs[0], key="holder", **fields)
    waiter = await new_action(store, runs[1], key="waiter", **fields)
    wide = await new_action(store, runs[1], key="wide", **target_fields(WIDE, namespace="lapse"))
    held = await store.claim_for_execution(holder["id"], 0.05)
    assert held.outcome == "claimed"
    await asyncio.sleep(0.3)
    assert await store.claim_action_for_execution(waiter["id"], 30) == "target_busy"
    assert await store.claim_action_for_execution(wide["id"], 30) == "target_busy"
    assert (await store.get_action(holder["id"]))["status"] == "executing"
    assert (await store.get_action(waiter["id"]))["status"] == "approved"
    # A retried claim of the lapsed action itself makes it unknown.
    assert await store.claim_action_for_execution(holder["id"], 30) == "unknown"
    for rival in (waiter, wide):
        assert (
            await store.claim_action_for_execution(rival["id"], 30)
            == "target_reconciliation_required"
        )
    await store.reconcile_action(holder["id"], "failed", "operator")
    got = await store.claim_for_execution(waiter["id"], 30)
    assert got.outcome == "claimed"
    assert got.action["fencing_token"] > held.action["fencing_token"]
    assert await store.claim_action_for_execution(wide["id"], 30) == "target_busy"
    for run in runs:
        assert await store.verify_audit_chain(run["id"])


# ------------------------------------------------------------ keys as SQL


@pytest.mark.parametrize(
    "hostile",
    ["o'brien", "x'); DELETE FROM action_leases; --", "%", "_", "a\\b", '"; DROP TABLE runs; --'],
)
async def test_keys_and_scopes_that_look_like_sql_are_only_values(store, hostile) -> None:
    run = await new_run(store)
    key = f"write:{hostile}"
    scope = f"scope:{hostile}"
    plain = await new_action(store, run, key="plain", target_key="write:plain", target_scope=scope)
    odd = await new_action(store, run, key="odd", target_key=key, target_scope=scope)
    other = await new_action(
        store, run, key="other", target_key="write:other", target_scope="scope:"
    )
    assert await store.claim_action_for_execution(plain["id"], 30) == "claimed"
    assert await store.claim_action_for_execution(odd["id"], 30) == "claimed"
    assert await store.claim_action_for_execution(other["id"], 30) == "claimed"
    async with store.session_factory() as session:
        keys = set((await session.execute(select(ActionLeaseRow.target_key))).scalars())
    assert keys == {"write:plain", key, "write:other"}
    assert await store.verify_audit_chain(run["id"])


# ------------------------------------------------------------ outcomes


async def test_a_claim_of_an_action_that_is_not_approved(store) -> None:
    run = await new_run(store)
    waiting = await new_action(
        store, run, key="waiting", status="waiting_approval", **target_fields("w")
    )
    finished = await new_action(store, run, key="finished", **target_fields("f"))
    assert await store.claim_action_for_execution(finished["id"], 30) == "claimed"
    assert await store.record_action_terminal_result(finished["id"], "failed", {})
    running = await new_action(store, run, key="running", **target_fields("r"))
    assert await store.claim_action_for_execution(running["id"], 30) == "claimed"
    withdrawn = await new_action(store, run, key="withdrawn", **target_fields("x"))
    await store.actions.withdraw(withdrawn["id"], "run_ended")

    assert await store.claim_action_for_execution(waiting["id"], 30) == "not_approved"
    assert await store.claim_action_for_execution(finished["id"], 30) == "already_finished"
    assert await store.claim_action_for_execution(withdrawn["id"], 30) == "already_finished"
    again = await store.claim_for_execution(running["id"], 30)
    assert again.outcome == ClaimOutcome.IN_PROGRESS and again.action is None
    with pytest.raises(NotFoundError):
        await store.claim_action_for_execution("no-such-action", 30)
    row = await store.get_action(running["id"])
    assert row["attempt_count"] == 1
    # No lease but the running one; the refused claims wrote no events.
    async with store.session_factory() as session:
        leased = list((await session.execute(select(ActionLeaseRow.action_id))).scalars())
    assert leased == [running["id"]]
    assert await store.verify_audit_chain(run["id"])


# ------------------------------------------------------------ closed runs


async def test_a_claim_racing_the_settling_of_a_closed_run_leaves_no_write_executing(
    store, monkeypatch
) -> None:
    """settle_closed lists the run's open writes, then withdraws each approved
    one. A claim that lands between the list and the withdrawal makes it
    executing: settling must then make it unknown like any other executing
    write (its attempt's workflow is gone), not leave it executing in a
    closed run."""
    run = await new_run(store)
    action = await new_action(store, run, key="raced", **target_fields("raced"))
    withdraw = store.actions.withdraw

    async def claim_first(action_id: str, reason: str) -> dict[str, Any]:
        if action_id == action["id"]:
            assert await store.claim_action_for_execution(action_id, 30) == "claimed"
        return await withdraw(action_id, reason)

    monkeypatch.setattr(store.actions, "withdraw", claim_first)
    settled = await store.settle_closed_run(run["id"], "terminated")
    row = await store.get_action(action["id"])
    assert row["status"] == "unknown", row["status"]
    assert settled["unknown_actions"] == [action["id"]]
    assert await store.verify_audit_chain(run["id"])


async def test_lease_rows_match_executing_and_unknown_actions(store) -> None:
    """Sanity after refused claims on PostgreSQL (which creates counter rows
    at 0 for them): no lease without an executing or unknown action."""
    run = await new_run(store)
    first = await new_action(store, run, key="a", **target_fields("same", namespace="zero"))
    second = await new_action(store, run, key="b", **target_fields("same", namespace="zero"))
    assert await store.claim_action_for_execution(first["id"], 30) == "claimed"
    assert await store.claim_action_for_execution(second["id"], 30) == "target_busy"
    async with store.session_factory() as session:
        rows = (
            await session.execute(
                select(ActionLeaseRow.action_id, ActionRow.status).join(
                    ActionRow, ActionRow.id == ActionLeaseRow.action_id
                )
            )
        ).all()
    assert [(r[0], r[1]) for r in rows] == [(first["id"], "executing")]


async def test_the_handed_over_action_is_the_row_as_committed(store) -> None:
    """What claim_for_execution hands the executor (built from the claim's
    RETURNING, no longer read back through the ORM) equals the action as
    stored, types included (aware datetimes, JSON, the token), and the sealed
    arguments are the stored ones."""
    from roundtable.store.schema import ActionSecretRow

    run = await new_run(store)
    action = await new_action(
        store,
        run,
        key="handed",
        arguments={"tenant_id": "tenant-a", "object_id": "handed", "note": "é'\""},
        **target_fields("handed", namespace="hand"),
    )
    claim = await store.claim_for_execution(action["id"], 30)
    assert claim.outcome == "claimed"
    stored = await store.get_action(action["id"])
    assert claim.action == stored
    for name, value in claim.action.items():
        assert type(value) is type(stored[name]), name
        if isinstance(value, datetime):
            assert value.tzinfo is not None, name
    async with store.session_factory() as session:
        sealed = (
            await session.execute(
                select(ActionSecretRow.arguments_encrypted).where(
                    ActionSecretRow.action_id == action["id"]
                )
            )
        ).scalar_one()
    assert claim.sealed_arguments == sealed


async def test_two_executors_claiming_one_write_at_once_start_it_once(store) -> None:
    """Both wait for the run; the first claims, the second finds the write
    executing under a live lease (in_progress): one attempt, one event."""
    run = await new_run(store)
    action = await new_action(store, run, key="twice", **target_fields("twice"))
    async with store.db.transaction() as session:
        await store.db.lock_run(session, run["id"])
        tasks = [
            asyncio.create_task(store.claim_action_for_execution(action["id"], 30))
            for _ in range(2)
        ]
        if _pg(store):
            await _blocked_on_locks(store, 2)
        else:
            await asyncio.sleep(0.2)
    assert sorted(await asyncio.gather(*tasks)) == ["claimed", "in_progress"]
    row = await store.get_action(action["id"])
    assert row["attempt_count"] == 1 and row["status"] == "executing"
    async with store.session_factory() as session:
        started = (
            await session.execute(
                select(AuditEventRow.seq).where(
                    AuditEventRow.run_id == run["id"],
                    AuditEventRow.event_type == "action.executing",
                )
            )
        ).all()
    assert len(started) == 1
    assert await store.verify_audit_chain(run["id"])


async def test_one_key_in_two_scopes_is_one_target_with_rising_tokens(store) -> None:
    """The same key written under two scopes: still one lease at a time, and
    each grant outranks the last on the key (its own counter), whichever
    scope's counter is behind."""
    runs = [await new_run(store) for _ in range(3)]
    key = target_fields("shared", namespace="one")["target_key"]
    a = await new_action(store, runs[0], key="a", target_key=key, target_scope="scope-one")
    b = await new_action(store, runs[1], key="b", target_key=key, target_scope="scope-two")
    c = await new_action(store, runs[2], key="c", target_key=key)
    first = await store.claim_for_execution(a["id"], 30)
    assert first.outcome == "claimed"
    assert await store.claim_action_for_execution(b["id"], 30) == "target_busy"
    assert await store.claim_action_for_execution(c["id"], 30) == "target_busy"
    assert await store.record_action_terminal_result(a["id"], "succeeded", {})
    second = await store.claim_for_execution(b["id"], 30)
    assert second.outcome == "claimed"
    assert await store.record_action_terminal_result(b["id"], "succeeded", {})
    third = await store.claim_for_execution(c["id"], 30)
    assert third.outcome == "claimed"
    tokens = [g.action["fencing_token"] for g in (first, second, third)]
    assert tokens == sorted(set(tokens)), tokens


async def test_a_counter_row_left_at_zero_by_a_refused_claim_changes_no_token(store) -> None:
    """PostgreSQL creates a new key's counter row at 0 even when the claim is
    refused (SQLite writes nothing): the key's next token still outranks
    every grant before it in its scope, on both."""
    from roundtable.store.schema import TargetFencingRow

    runs = [await new_run(store) for _ in range(2)]
    wide = await new_action(store, runs[0], key="wide", **target_fields(WIDE, namespace="zero"))
    fresh = await new_action(store, runs[1], key="fresh", **target_fields("new", namespace="zero"))
    held = await store.claim_for_execution(wide["id"], 30)
    assert held.outcome == "claimed"
    assert await store.claim_action_for_execution(fresh["id"], 30) == "target_busy"
    async with store.session_factory() as session:
        counter = (
            await session.execute(
                select(TargetFencingRow.last_token).where(
                    TargetFencingRow.target_key == fresh["target_key"]
                )
            )
        ).scalar_one_or_none()
    assert counter == (0 if _pg(store) else None)
    assert await store.record_action_terminal_result(wide["id"], "succeeded", {})
    got = await store.claim_for_execution(fresh["id"], 30)
    assert got.outcome == "claimed"
    assert got.action["fencing_token"] == held.action["fencing_token"] + 1
