"""Claims, target leases, fencing, recovery and reconciliation, on both databases."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

from roundtable.store import ClaimOutcome, ConflictError, InvalidInputError, NotFoundError
from roundtable.store.errors import AttemptMayBeRunningError
from roundtable.store.schema import ActionLeaseRow, ActionRow
from tests.helpers import new_action, new_run, set_column, target_for

LEASE_EXPIRED = {"error_code": "target_lease_expired_during_execution"}


async def live_state(store, target_key: str) -> tuple[int, int]:
    """(lease rows, executing actions) for a target, read from the database."""
    async with store.session_factory() as session:
        leases = (
            await session.execute(
                select(func.count()).where(ActionLeaseRow.target_key == target_key)
            )
        ).scalar_one()
        executing = (
            await session.execute(
                select(func.count()).where(
                    ActionRow.target_key == target_key, ActionRow.status == "executing"
                )
            )
        ).scalar_one()
    return leases, executing


async def test_two_agents_on_one_target_are_serialized(store) -> None:
    run = await new_run(store)
    target = target_for()
    first = await new_action(store, run, key="first", target_key=target)
    second = await new_action(store, run, key="second", target_key=target, agent_id="seat-2")

    outcomes = await asyncio.gather(
        store.claim_action_for_execution(first["id"], lease_seconds=30),
        store.claim_action_for_execution(second["id"], lease_seconds=30),
    )
    assert sorted(outcomes) == ["claimed", "target_busy"]
    assert all(isinstance(o, ClaimOutcome) for o in outcomes)
    winner, waiting = (first, second) if outcomes[0] == "claimed" else (second, first)
    assert (await store.get_action(waiting["id"]))["status"] == "approved"
    assert await live_state(store, target) == (1, 1)

    assert await store.record_action_terminal_result(winner["id"], "succeeded", {"ok": True})
    assert await live_state(store, target) == (0, 0)
    assert await store.claim_action_for_execution(waiting["id"], lease_seconds=30) == "claimed"


async def test_other_targets_are_not_blocked(store) -> None:
    run = await new_run(store)
    a = await new_action(store, run, key="a", target_key=target_for("task-1"))
    b = await new_action(store, run, key="b", target_key=target_for("task-2"))
    assert await store.claim_action_for_execution(a["id"], 30) == "claimed"
    assert await store.claim_action_for_execution(b["id"], 30) == "claimed"


async def test_fifty_concurrent_claimers_never_hold_two_leases(store) -> None:
    """Spread over ten runs so the lease row, not the run lock, is what serialises."""
    target = target_for("hot-ticket")
    runs = [await new_run(store) for _ in range(10)]
    remaining = [
        (await new_action(store, runs[i % 10], key=f"claimer-{i}", target_key=target))["id"]
        for i in range(50)
    ]
    tokens: list[int] = []
    while remaining:
        outcomes = await asyncio.gather(
            *(store.claim_action_for_execution(a, lease_seconds=30) for a in remaining)
        )
        winners = [a for a, o in zip(remaining, outcomes, strict=True) if o == "claimed"]
        assert len(winners) == 1, outcomes
        assert set(outcomes) <= {"claimed", "target_busy"}
        assert await live_state(store, target) == (1, 1)
        winner = await store.get_action(winners[0])
        assert winner["status"] == "executing"
        tokens.append(winner["fencing_token"])
        assert await store.record_action_terminal_result(winner["id"], "succeeded", {})
        remaining.remove(winner["id"])
    assert tokens == sorted(set(tokens)) and len(tokens) == 50
    assert tokens == list(range(1, 51))


async def test_same_action_claimed_twice_concurrently_runs_once(store) -> None:
    run = await new_run(store)
    action = await new_action(store, run, key="dup", target_key=target_for())
    outcomes = await asyncio.gather(
        *(store.claim_action_for_execution(action["id"], 30) for _ in range(5))
    )
    assert sorted(outcomes) == ["claimed"] + ["in_progress"] * 4
    stored = await store.get_action(action["id"])
    assert stored["attempt_count"] == 1 and stored["fencing_token"] == 1


async def test_fencing_tokens_increase_per_target_and_independently(store) -> None:
    run = await new_run(store)
    seen: dict[str, list[int]] = {"x": [], "y": []}
    for i in range(3):
        for name in ("x", "y"):
            action = await new_action(store, run, key=f"{name}-{i}", target_key=target_for(name))
            assert await store.claim_action_for_execution(action["id"], 30) == "claimed"
            seen[name].append((await store.get_action(action["id"]))["fencing_token"])
            await store.record_action_terminal_result(action["id"], "failed", {"why": "x"})
    assert seen == {"x": [1, 2, 3], "y": [1, 2, 3]}


async def test_claim_answers_for_every_state(store) -> None:
    run = await new_run(store)
    waiting = await new_action(
        store, run, key="w", target_key=target_for("w"), status="waiting_approval"
    )
    assert await store.claim_action_for_execution(waiting["id"], 30) == "not_approved"

    done = await new_action(store, run, key="d", target_key=target_for("d"))
    assert await store.claim_action_for_execution(done["id"], 30) == "claimed"
    assert await store.claim_action_for_execution(done["id"], 30) == "in_progress"
    assert await store.record_action_terminal_result(done["id"], "succeeded", {})
    assert await store.claim_action_for_execution(done["id"], 30) == "already_finished"

    lost = await new_action(store, run, key="u", target_key=target_for("u"))
    assert await store.claim_action_for_execution(lost["id"], 30) == "claimed"
    assert await store.record_action_terminal_result(lost["id"], "unknown", {"error_code": "x"})
    assert await store.claim_action_for_execution(lost["id"], 30) == "unknown"

    with pytest.raises(NotFoundError):
        await store.claim_action_for_execution("no-such-action", 30)
    for bad in (0, -1, "30", True, 10**9):
        with pytest.raises(InvalidInputError):
            await store.claim_action_for_execution(done["id"], bad)


async def test_expired_lease_becomes_unknown_and_blocks_the_target(store) -> None:
    run = await new_run(store)
    target = target_for()
    action = await new_action(store, run, key="restart", target_key=target)
    assert await store.claim_action_for_execution(action["id"], lease_seconds=1) == "claimed"

    # Not yet expired by the clock we pass: nothing changes.
    assert await store.recover_expired_action_leases(run_id=run["id"]) == []
    later = datetime.now(UTC) + timedelta(seconds=5)
    recovered = await store.recover_expired_action_leases(run_id=run["id"], now=later)
    assert [item["id"] for item in recovered] == [action["id"]]
    assert recovered[0]["status"] == "unknown"
    stored = await store.get_action(action["id"])
    assert stored["status"] == "unknown" and stored["result"] == LEASE_EXPIRED
    assert await store.recover_expired_action_leases(run_id=run["id"], now=later) == []

    assert await store.claim_action_for_execution(action["id"], 30) == "unknown"
    blocked = await new_action(store, run, key="blocked", target_key=target, agent_id="seat-2")
    assert await store.claim_action_for_execution(blocked["id"], 30) == (
        "target_reconciliation_required"
    )
    # A late result from the lost executor does not overwrite unknown.
    assert not await store.record_action_terminal_result(action["id"], "succeeded", {})
    events = [e["event_type"] for e in await store.list_events(run["id"])]
    assert events.count("action.unknown") == 1


async def test_recovery_by_database_clock_and_lost_result_never_replays(store) -> None:
    """The tool ran, but its result was never recorded: the executor's second
    attempt is told ``in_progress``; after the lease lapses it is ``unknown``."""
    run = await new_run(store)
    action = await new_action(
        store,
        run,
        key="persist-failure",
        target_key=target_for(),
        arguments={"tenant_id": "tenant-a", "object_id": "task-7"},
    )
    assert await store.claim_action_for_execution(action["id"], 30) == "claimed"
    # (the tool is invoked here and the result write is lost)
    assert await store.claim_action_for_execution(action["id"], 30) == "in_progress"

    past = datetime.now(UTC) - timedelta(seconds=1)
    await set_column(
        store, ActionLeaseRow, ActionLeaseRow.action_id == action["id"], lease_expires_at=past
    )
    recovered = await store.recover_expired_action_leases()
    assert [item["id"] for item in recovered] == [action["id"]]
    assert await store.claim_action_for_execution(action["id"], 30) == "unknown"
    assert (await store.get_action(action["id"]))["attempt_count"] == 1


async def test_claim_of_own_expired_lease_turns_unknown(store) -> None:
    run = await new_run(store)
    action = await new_action(store, run, key="own", target_key=target_for())
    assert await store.claim_action_for_execution(action["id"], 30) == "claimed"
    await set_column(
        store,
        ActionLeaseRow,
        ActionLeaseRow.action_id == action["id"],
        lease_expires_at=datetime.now(UTC) - timedelta(seconds=1),
    )
    assert await store.claim_action_for_execution(action["id"], 30) == "unknown"
    assert (await store.get_action(action["id"]))["result"] == LEASE_EXPIRED


async def test_expired_lease_is_never_handed_to_another_action(store) -> None:
    run = await new_run(store)
    target = target_for()
    holder = await new_action(store, run, key="holder", target_key=target)
    other = await new_action(store, run, key="other", target_key=target)
    assert await store.claim_action_for_execution(holder["id"], 30) == "claimed"
    await set_column(
        store,
        ActionLeaseRow,
        ActionLeaseRow.action_id == holder["id"],
        lease_expires_at=datetime.now(UTC) - timedelta(seconds=1),
    )
    # Until recovery runs, the target is simply busy; it is never taken over.
    assert await store.claim_action_for_execution(other["id"], 30) == "target_busy"
    await store.recover_expired_action_leases()
    assert await store.claim_action_for_execution(other["id"], 30) == (
        "target_reconciliation_required"
    )


async def test_renewal_is_fenced(store) -> None:
    run = await new_run(store)
    action = await new_action(store, run, key="renew", target_key=target_for())
    assert await store.claim_action_for_execution(action["id"], 5) == "claimed"
    token = (await store.get_action(action["id"]))["fencing_token"]

    async def expiry() -> datetime:
        async with store.session_factory() as session:
            return (
                await session.execute(
                    select(ActionLeaseRow.lease_expires_at).where(
                        ActionLeaseRow.action_id == action["id"]
                    )
                )
            ).scalar_one()

    before = await expiry()
    assert await store.renew_action_lease(action["id"], token, 600)
    assert await expiry() > before + timedelta(seconds=500)
    assert not await store.renew_action_lease(action["id"], token + 1, 600)
    assert not await store.renew_action_lease("no-such-action", token, 600)

    await set_column(
        store,
        ActionLeaseRow,
        ActionLeaseRow.action_id == action["id"],
        lease_expires_at=datetime.now(UTC) - timedelta(seconds=1),
    )
    assert not await store.renew_action_lease(action["id"], token, 600)


async def test_terminal_result_rules(store) -> None:
    run = await new_run(store)
    action = await new_action(store, run, key="term", target_key=target_for())
    assert not await store.record_action_terminal_result(action["id"], "succeeded", {})
    assert await store.claim_action_for_execution(action["id"], 30) == "claimed"
    token = (await store.get_action(action["id"]))["fencing_token"]
    with pytest.raises(InvalidInputError):
        await store.record_action_terminal_result(action["id"], "approved", {})
    assert not await store.record_action_terminal_result(
        action["id"], "succeeded", {}, fencing_token=token + 1
    )
    assert await store.record_action_terminal_result(
        action["id"], "succeeded", {"ticket": 7}, fencing_token=token, external_object_id="T-7"
    )
    stored = await store.get_action(action["id"])
    assert stored["status"] == "succeeded" and stored["external_object_id"] == "T-7"
    assert stored["finished_at"] >= stored["started_at"]
    assert not await store.record_action_terminal_result(action["id"], "failed", {})


async def test_reconcile_unblocks_the_target(store) -> None:
    run = await new_run(store)
    target = target_for()
    lost = await new_action(store, run, key="lost", target_key=target)
    assert await store.claim_action_for_execution(lost["id"], 30) == "claimed"
    assert await store.record_action_terminal_result(
        lost["id"], "unknown", {"error_code": "e"}, attempt_over=True
    )
    assert await live_state(store, target) == (1, 0)

    nxt = await new_action(store, run, key="next", target_key=target)
    assert await store.claim_action_for_execution(nxt["id"], 30) == (
        "target_reconciliation_required"
    )
    with pytest.raises(InvalidInputError):
        await store.reconcile_action(lost["id"], "unknown", "op", "no")
    with pytest.raises(InvalidInputError):
        await store.reconcile_action(lost["id"], "succeeded", "", "no operator")
    settled = await store.reconcile_action(lost["id"], "succeeded", "op-1", "checked CRM")
    assert settled["status"] == "succeeded"
    assert settled["result"]["reconciled_by"] == "op-1"
    with pytest.raises(ConflictError):
        await store.reconcile_action(lost["id"], "failed", "op-1", "again")
    with pytest.raises(ConflictError):
        await store.reconcile_action(nxt["id"], "failed", "op-1", "not unknown")

    assert await live_state(store, target) == (0, 0)
    assert await store.claim_action_for_execution(nxt["id"], 30) == "claimed"
    reconciled = [
        e for e in await store.list_events(run["id"]) if e["event_type"] == "action.reconciled"
    ]
    assert reconciled[0]["payload"] == {
        "action_id": lost["id"],
        "outcome": "succeeded",
        "decided_by": "op-1",
        "note": "checked CRM",
    }


async def test_concurrent_recovery_changes_each_action_once(store) -> None:
    run = await new_run(store)
    ids = []
    for i in range(4):
        action = await new_action(store, run, key=f"rec-{i}", target_key=target_for(f"r{i}"))
        assert await store.claim_action_for_execution(action["id"], 1) == "claimed"
        ids.append(action["id"])
    later = datetime.now(UTC) + timedelta(seconds=10)
    results = await asyncio.gather(
        *(store.recover_expired_action_leases(now=later) for _ in range(3))
    )
    changed = sorted(item["id"] for batch in results for item in batch)
    assert changed == sorted(ids)
    events = [e["event_type"] for e in await store.list_events(run["id"])]
    assert events.count("action.unknown") == 4


async def test_reconcile_is_refused_while_the_attempt_may_still_be_running(store) -> None:
    """An action made unknown by someone other than its attempt (the workflow
    after a heartbeat timeout, the sweep after a closed run) may still have a
    live tool call on a frozen worker: reconciling it then would let the next
    writer claim the target while the old one can still write."""
    run = await new_run(store)
    target = target_for()
    lost = await new_action(store, run, key="lost", target_key=target)
    assert await store.claim_action_for_execution(lost["id"], 30) == "claimed"
    assert await store.record_action_terminal_result(lost["id"], "unknown", {"error_code": "e"})
    with pytest.raises(AttemptMayBeRunningError) as refused:
        await store.reconcile_action(lost["id"], "failed", "op-1", "ticket untouched")
    lease_end = (await lease_of(store, lost["id"])).lease_expires_at
    assert refused.value.retry_at == lease_end
    assert "Reconcile after" in str(refused.value) and isinstance(refused.value, ConflictError)
    assert (await store.get_action(lost["id"]))["status"] == "unknown"  # nothing changed

    await set_column(
        store,
        ActionLeaseRow,
        ActionLeaseRow.action_id == lost["id"],
        lease_expires_at=datetime.now(UTC) - timedelta(seconds=1),
    )
    settled = await store.reconcile_action(lost["id"], "failed", "op-1", "ticket untouched")
    assert settled["status"] == "failed"


async def test_an_attempt_that_recorded_unknown_itself_is_over(store) -> None:
    run = await new_run(store)
    action = await new_action(store, run, key="own", target_key=target_for())
    assert await store.claim_action_for_execution(action["id"], 30) == "claimed"
    assert await store.record_action_terminal_result(
        action["id"], "unknown", {"error_code": "tool_error"}, attempt_over=True
    )
    lease = await lease_of(store, action["id"])
    assert lease is not None  # the target stays blocked...
    assert not await store.renew_action_lease(action["id"], lease.fencing_token, 30)
    settled = await store.reconcile_action(action["id"], "succeeded", "op-1", "seen in CRM")
    assert settled["status"] == "succeeded"  # ...but reconciling needs no wait
    assert await lease_of(store, action["id"]) is None


async def lease_of(store, action_id: str) -> ActionLeaseRow | None:
    async with store.session_factory() as session:
        return (
            await session.execute(
                select(ActionLeaseRow).where(ActionLeaseRow.action_id == action_id)
            )
        ).scalar_one_or_none()


async def test_a_claim_hands_the_executor_its_action_and_sealed_arguments(store) -> None:
    """What the executor needs next is read in the claim's own transaction:
    the action as executing, with the token it was just given, and its
    arguments still sealed; a claim that does not claim hands over nothing."""
    from roundtable.security import decrypt_arguments

    run = await new_run(store)
    target = target_for("handed")
    arguments = {"ticket": "T-9", "note": "secret-ish"}
    first = await new_action(store, run, key="handed-1", target_key=target, arguments=arguments)
    second = await new_action(store, run, key="handed-2", target_key=target, arguments=arguments)

    claimed = await store.claim_for_execution(first["id"], 30)
    assert claimed.outcome == ClaimOutcome.CLAIMED
    assert claimed.action["status"] == "executing" and claimed.action["attempt_count"] == 1
    assert claimed.action["fencing_token"] == (await store.get_action(first["id"]))["fencing_token"]
    assert claimed.action["fencing_token"] >= 1
    assert claimed.sealed_arguments is not None and "secret-ish" not in claimed.sealed_arguments
    opened = decrypt_arguments(claimed.sealed_arguments, associated_data=first["id"].encode())
    assert opened == arguments

    busy = await store.claim_for_execution(second["id"], 30)
    assert busy.outcome == ClaimOutcome.TARGET_BUSY
    assert busy.action is None and busy.sealed_arguments is None


@pytest.mark.parametrize(
    ("ending", "told"), [("succeeded", "already_finished"), ("unknown", "unknown")]
)
async def test_an_attempt_ending_between_the_claims_two_transactions(
    store, ending: str, told: str
) -> None:
    """A claim that finds its action executing settles it in a second
    transaction, under the run lock. If the attempt's result lands between
    the two, the claim answers with the action's end and changes nothing:
    no second attempt, no unknown made of a recorded result."""
    run = await new_run(store)
    action = await new_action(store, run, key="between", target_key=target_for())
    assert await store.claim_action_for_execution(action["id"], 30) == "claimed"
    token = (await store.get_action(action["id"]))["fencing_token"]
    leases = store.leases
    settle = leases._settle_executing

    async def result_lands_first(action_id: str) -> ClaimOutcome:
        assert await store.record_action_terminal_result(
            action_id, ending, {"error_code": "tool_error"}, fencing_token=token
        )
        return await settle(action_id)

    leases._settle_executing = result_lands_first
    try:
        assert await store.claim_action_for_execution(action["id"], 30) == told
    finally:
        leases._settle_executing = settle
    after = await store.get_action(action["id"])
    assert after["status"] == ending
    assert after["attempt_count"] == 1
    assert after["result"] == {"error_code": "tool_error"}
    assert await store.verify_audit_chain(run["id"])


@pytest.mark.parametrize("extend", ["renew", "hold"])
async def test_a_lease_that_lapses_while_its_renewal_waits_for_the_lock_is_not_renewed(
    tmp_path, extend: str
) -> None:
    """SQLite: another process (a second worker, the CLI) holds the write lock
    past the lease's end while a renewal waits for it. The renewal must judge
    the lease by the clock once it holds the lock: judged by the clock it read
    before waiting, a lease that had already lapsed was extended, and an
    attempt whose outcome was already in doubt went on as if it held its
    target. (PostgreSQL reads its clock in the statement, after its locks.)"""
    import sqlite3

    from roundtable.store import open_store

    path = tmp_path / "roundtable.db"
    async with open_store(f"sqlite+aiosqlite:///{path}") as store:
        run = await new_run(store)
        action = await new_action(store, run, key="lapsing", target_key=target_for("lapsing"))
        assert await store.claim_action_for_execution(action["id"], lease_seconds=1) == "claimed"
        token = (await store.get_action(action["id"]))["fencing_token"]
        other = sqlite3.connect(path, isolation_level=None, timeout=30)
        try:
            other.execute("BEGIN IMMEDIATE")
            if extend == "renew":
                waiting = asyncio.ensure_future(store.renew_action_lease(action["id"], token, 30))
            else:
                waiting = asyncio.ensure_future(store.hold_action_lease(action["id"], token, 30))
            await asyncio.sleep(1.5)  # the renewal waits; the lease's second runs out
            assert not waiting.done()
            other.execute("ROLLBACK")
        finally:
            other.close()
        assert not await waiting  # False / None: the lease was lost, not extended
        async with store.session_factory() as session:
            lease = (
                await session.execute(
                    select(ActionLeaseRow).where(ActionLeaseRow.action_id == action["id"])
                )
            ).scalar_one()
        expires = lease.lease_expires_at.replace(tzinfo=UTC)
        assert expires < datetime.now(UTC)  # still the lapsed lease
