"""Approvals: decided or expired exactly once; reads never mutate."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from roundtable.store import ConflictError, InvalidInputError, NotFoundError
from roundtable.store.schema import ApprovalRow
from tests.helpers import new_action, new_run, set_column, target_for


async def waiting_action(store, run, key: str = "w", minutes: int = 1):
    action = await new_action(
        store, run, key=key, target_key=target_for(key), status="waiting_approval"
    )
    approval = await store.create_approval(
        action_id=action["id"], expires_at=datetime.now(UTC) + timedelta(minutes=minutes)
    )
    return action, approval


async def make_overdue(store, approval_id: str) -> None:
    await set_column(
        store,
        ApprovalRow,
        ApprovalRow.id == approval_id,
        expires_at=datetime.now(UTC) - timedelta(seconds=1),
    )


async def test_approve_then_execute(store) -> None:
    run = await new_run(store)
    action, approval = await waiting_action(store, run)
    assert approval["status"] == "pending"
    assert (await store.get_action(action["id"]))["approval_id"] == approval["id"]

    decided = await store.decide_approval(approval["id"], "approved", "op-1", "looks right")
    assert decided["status"] == "approved" and decided["decided_by"] == "op-1"
    assert (await store.get_action(action["id"]))["status"] == "approved"
    assert await store.claim_action_for_execution(action["id"], 30) == "claimed"
    with pytest.raises(ConflictError):
        await store.decide_approval(approval["id"], "rejected", "op-2")


async def test_reject_is_final(store) -> None:
    run = await new_run(store)
    action, approval = await waiting_action(store, run)
    await store.decide_approval(approval["id"], "rejected", "op-1", "wrong ticket")
    stored = await store.get_action(action["id"])
    assert stored["status"] == "rejected" and stored["finished_at"] is not None
    assert await store.claim_action_for_execution(action["id"], 30) == "already_finished"
    with pytest.raises(ConflictError):
        await store.decide_approval(approval["id"], "approved", "op-1")


async def test_concurrent_decisions_have_one_winner(store) -> None:
    run = await new_run(store)
    _, approval = await waiting_action(store, run)
    results = await asyncio.gather(
        store.decide_approval(approval["id"], "approved", "alice"),
        store.decide_approval(approval["id"], "rejected", "bob"),
        return_exceptions=True,
    )
    winners = [r for r in results if isinstance(r, dict)]
    assert len(winners) == 1
    assert sum(isinstance(r, ConflictError) for r in results) == 1
    stored = await store.get_approval(approval["id"])
    assert stored["status"] == winners[0]["status"]
    assert stored["decided_by"] == winners[0]["decided_by"]


async def test_expiry_rejects_the_action_audits_and_later_decision_conflicts(store) -> None:
    run = await new_run(store)
    action, approval = await waiting_action(store, run)

    expired = await store.expire_due_approvals(
        run_id=run["id"], now=datetime.now(UTC) + timedelta(minutes=2)
    )
    assert expired == [{"id": approval["id"], "run_id": run["id"], "action_id": action["id"]}]
    assert (await store.get_approval(approval["id"]))["status"] == "expired"
    assert (await store.get_action(action["id"]))["status"] == "rejected"
    with pytest.raises(ConflictError):
        await store.decide_approval(approval["id"], "approved", "u1")

    events = await store.list_events(run["id"])
    assert any(
        e["event_type"] == "action.rejected" and e["payload"].get("reason") == "approval_expired"
        for e in events
    )
    assert any(e["event_type"] == "approval.expired" for e in events)


async def test_expiry_scans_are_repeatable_and_listing_is_observational(store) -> None:
    run = await new_run(store)
    action, approval = await waiting_action(store, run, "scan")
    await make_overdue(store, approval["id"])

    # Reading an overdue approval never expires it.
    for _ in range(2):
        listed = await store.list_approvals(run_id=run["id"])
        assert [a["status"] for a in listed] == ["pending"]
        assert (await store.get_approval(approval["id"]))["status"] == "pending"
    assert (await store.get_action(action["id"]))["status"] == "waiting_approval"

    concurrent = await asyncio.gather(store.expire_due_approvals(), store.expire_due_approvals())
    assert sorted(concurrent, key=len) == [
        [],
        [{"id": approval["id"], "run_id": run["id"], "action_id": action["id"]}],
    ]
    assert await store.expire_due_approvals() == []
    events = [e["event_type"] for e in await store.list_events(run["id"])]
    assert events.count("approval.expired") == 1 and events.count("action.rejected") == 1


async def test_expiry_only_touches_due_approvals_of_the_run_asked(store) -> None:
    run_a, run_b = await new_run(store), await new_run(store)
    _, due_a = await waiting_action(store, run_a, "a")
    _, due_b = await waiting_action(store, run_b, "b")
    _, later = await waiting_action(store, run_a, "c", minutes=60)
    for approval in (due_a, due_b):
        await make_overdue(store, approval["id"])
    assert [e["id"] for e in await store.expire_due_approvals(run_id=run_a["id"])] == [due_a["id"]]
    assert (await store.get_approval(due_b["id"]))["status"] == "pending"
    assert (await store.get_approval(later["id"]))["status"] == "pending"
    assert [e["id"] for e in await store.expire_due_approvals()] == [due_b["id"]]


async def test_a_late_decision_expires_instead_of_approving(store) -> None:
    run = await new_run(store)
    action, approval = await waiting_action(store, run)
    await make_overdue(store, approval["id"])
    with pytest.raises(ConflictError, match="expired"):
        await store.decide_approval(approval["id"], "approved", "op-1")
    assert (await store.get_approval(approval["id"]))["status"] == "expired"
    assert (await store.get_action(action["id"]))["status"] == "rejected"


async def test_workflow_timer_expiry_is_compare_and_set(store) -> None:
    run = await new_run(store)
    _, approval = await waiting_action(store, run, "t1")
    assert await store.expire_approval(approval["id"])
    assert not await store.expire_approval(approval["id"])
    _, decided = await waiting_action(store, run, "t2")
    await store.decide_approval(decided["id"], "approved", "op")
    assert not await store.expire_approval(decided["id"])
    assert (await store.get_approval(decided["id"]))["status"] == "approved"


async def test_approval_input_errors(store) -> None:
    run = await new_run(store)
    action, approval = await waiting_action(store, run)
    with pytest.raises(InvalidInputError):
        await store.decide_approval(approval["id"], "maybe", "op")
    with pytest.raises(InvalidInputError):
        await store.decide_approval(approval["id"], "approved", "  ")
    with pytest.raises(NotFoundError):
        await store.decide_approval("nope", "approved", "op")
    with pytest.raises(ConflictError):  # one open question per action
        await store.create_approval(
            action_id=action["id"], expires_at=datetime.now(UTC) + timedelta(minutes=5)
        )
    approved = await new_action(store, run, key="ok", target_key=target_for("ok"))
    with pytest.raises(ConflictError):
        await store.create_approval(
            action_id=approved["id"], expires_at=datetime.now(UTC) + timedelta(minutes=5)
        )
    other = await new_action(
        store, run, key="o", target_key=target_for("o"), status="waiting_approval"
    )
    with pytest.raises(InvalidInputError):
        await store.create_approval(
            action_id=other["id"], expires_at=datetime.now(UTC) - timedelta(seconds=1)
        )
    with pytest.raises(InvalidInputError):
        await store.create_approval(action_id=other["id"], expires_at=datetime(2030, 1, 1))
    with pytest.raises(InvalidInputError):
        await store.list_approvals(status="bogus")
    with pytest.raises(InvalidInputError):
        await store.expire_due_approvals(now=datetime(2030, 1, 1))
    # Nothing above changed anything.
    assert (await store.get_approval(approval["id"]))["status"] == "pending"
    assert [a["id"] for a in await store.list_approvals(status="pending")] == [approval["id"]]


async def test_action_and_its_approval_are_created_together_once(store) -> None:
    run = await new_run(store)
    deadline = datetime.now(UTC) + timedelta(minutes=5)
    fields = {"approval_expires_at": deadline, "status": "waiting_approval"}
    first = await new_action(store, run, key="call-1", target_key=target_for(), **fields)
    again = await new_action(store, run, key="call-1", target_key=target_for(), **fields)
    assert again["id"] == first["id"] and first["approval_id"] is not None
    approvals = await store.list_approvals(run_id=run["id"])
    assert [a["id"] for a in approvals] == [first["approval_id"]]
    assert approvals[0]["expires_at"] == deadline
    with pytest.raises(InvalidInputError):  # only waiting actions ask
        await new_action(
            store, run, key="call-2", target_key=target_for("x"), approval_expires_at=deadline
        )


async def test_a_write_the_policy_refuses_is_recorded_rejected(store) -> None:
    run = await new_run(store)
    denied = await new_action(store, run, key="deny", target_key=target_for(), status="rejected")
    assert denied["status"] == "rejected"
    assert denied["result"] == {"error_code": "denied_by_policy"}
    assert await store.claim_action_for_execution(denied["id"], 30) == "already_finished"
    created = [e for e in await store.list_events(run["id"]) if e["event_type"] == "action.created"]
    assert created[0]["payload"]["status"] == "rejected"


async def test_extension_pushes_a_pending_deadline_and_is_audited(store) -> None:
    run = await new_run(store)
    _, approval = await waiting_action(store, run, "ext")
    extended = await store.extend_approval(approval["id"], 600, "op-1", max_seconds=3600)
    assert extended["expires_at"] == approval["expires_at"] + timedelta(seconds=600)
    events = [
        e for e in await store.list_events(run["id"]) if e["event_type"] == "approval.extended"
    ]
    assert events[0]["payload"]["by"] == "op-1"
    with pytest.raises(InvalidInputError):
        await store.extend_approval(approval["id"], 7200, "op-1", max_seconds=3600)
    with pytest.raises(InvalidInputError):
        await store.extend_approval(approval["id"], 0, "op-1", max_seconds=3600)
    await make_overdue(store, approval["id"])
    with pytest.raises(ConflictError, match="expired"):
        await store.extend_approval(approval["id"], 60, "op-1", max_seconds=3600)
    _, decided = await waiting_action(store, run, "ext2")
    await store.decide_approval(decided["id"], "rejected", "op")
    with pytest.raises(ConflictError):
        await store.extend_approval(decided["id"], 60, "op-1", max_seconds=3600)
