"""The decision and a write's outcome as plain statements (roundtable/store/
decision.py and outcome.py, issue 12), on both databases: how many statements
each sends, that each leaves the rows, the log and the run exactly as its
rules say, and that a refusal leaves nothing written. The rules themselves
(decided once, before the deadline, on the arguments shown, by whom may;
recorded once, by the attempt holding the token) are tested in
test_store_approvals.py, test_authority.py, test_store_leases.py,
test_store_endings.py and test_store_state_machine.py."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from roundtable.store import ConflictError, NotFoundError
from roundtable.store.commit_notes import ActionEnded, ApprovalSettled
from roundtable.store.schema import ActionLeaseRow, ApprovalRow, RunRow, SessionRow
from tests.helpers import new_action, new_run, set_column, target_for
from tests.test_claim_cut import counting
from tests.test_store_approvals import make_overdue, waiting_action

# Statements per decision (SQLAlchemy cursor events: BEGIN IMMEDIATE counts on
# SQLite; asyncpg's own BEGIN and COMMIT are not seen on PostgreSQL).
# PostgreSQL: the run lock, the read, the approval, the action, the events,
# the run's head. SQLite: BEGIN IMMEDIATE instead of the lock.
DECIDED = {"postgresql": 6, "sqlite": 6}
# … and, moving the run back to running: the check that nothing else of the
# run still waits, and the run's session.
DECIDED_AND_RUNNING = {"postgresql": 8, "sqlite": 8}


async def _run_in(store, status: str, failure: dict | None = None) -> dict:
    run = await new_run(store)
    await set_column(store, RunRow, RunRow.id == run["id"], status=status, failure=failure)
    return await store.get_run(run["id"])


async def _session_status(store, session_id: str) -> str:
    async with store.db.reader() as session:
        return (
            await session.execute(select(SessionRow.status).where(SessionRow.id == session_id))
        ).scalar_one()


async def _head(store, run_id: str) -> tuple[int, str]:
    run = await store.get_run(run_id)
    return run["last_event_seq"], run["last_event_hash"]


async def test_a_decision_is_six_statements_and_leaves_what_it_returns(store) -> None:
    dialect = store.engine.dialect.name
    run = await _run_in(store, "waiting_input")
    action, approval = await waiting_action(store, run, "one")
    _, other = await waiting_action(store, run, "two")

    with counting(store) as seen:
        decided = await store.decide_approval(
            approval["id"], "approved", "op-1", "fine", run_status="running"
        )
    # Another approval of the run is still open: the run stays waiting.
    assert len(seen) == DECIDED_AND_RUNNING[dialect] - 1, seen
    stored = await store.get_approval(approval["id"])
    assert {k: decided[k] for k in stored} == stored
    assert stored["status"] == "approved" and stored["decided_by"] == "op-1"
    assert stored["decision_reason"] == "fine" and stored["decided_at"] is not None
    assert (
        decided["action_status"] == "approved" == (await store.get_action(action["id"]))["status"]
    )
    assert decided["run_status"] == "waiting_input"
    assert (await store.get_run(run["id"]))["status"] == "waiting_input"

    with counting(store) as seen:
        rejected = await store.decide_approval(
            other["id"], "rejected", "op-2", None, run_status="running"
        )
    assert len(seen) == DECIDED_AND_RUNNING[dialect], seen
    assert rejected["action_status"] == "rejected" and rejected["run_status"] == "running"
    assert (await store.get_action(other["action_id"]))["finished_at"] is not None
    assert (await store.get_run(run["id"]))["status"] == "running"
    assert await _session_status(store, run["session_id"]) == "running"

    events = await store.list_events(run["id"])
    assert [e["event_type"] for e in events[-5:]] == [
        "approval.approved",
        "action.approved",
        "approval.rejected",
        "action.rejected",
        "run.status_changed",
    ]
    assert events[-1]["payload"] == {"from": "waiting_input", "to": "running"}
    assert events[-2]["payload"] == {
        "approval_id": other["id"],
        "action_id": other["action_id"],
        "decided_by": "op-2",
        "reason": None,
    }
    assert await store.verify_audit_chain(run["id"])
    assert await _head(store, run["id"]) == (events[-1]["seq"], events[-1]["hash"])


async def test_a_decision_without_a_run_status_is_six_statements(store) -> None:
    run = await _run_in(store, "waiting_input")
    _, approval = await waiting_action(store, run)
    with counting(store) as seen:
        decided = await store.decide_approval(approval["id"], "approved", "op-1")
    assert len(seen) == DECIDED[store.engine.dialect.name], seen
    assert decided["run_status"] == "waiting_input"


async def test_a_stalled_run_moved_by_a_decision_loses_its_failure(store) -> None:
    run = await _run_in(store, "stalled", failure={"error": "tool worker gone"})
    _, approval = await waiting_action(store, run)
    decided = await store.decide_approval(approval["id"], "approved", "op-1", run_status="running")
    assert decided["run_status"] == "running"
    moved = await store.get_run(run["id"])
    assert moved["status"] == "running" and moved["failure"] is None


async def test_an_ended_run_is_not_moved_by_a_decision(store) -> None:
    run = await _run_in(store, "cancelled")
    _, approval = await waiting_action(store, run)
    decided = await store.decide_approval(approval["id"], "rejected", "op-1", run_status="running")
    assert decided["run_status"] == "cancelled"
    assert (await store.get_run(run["id"]))["status"] == "cancelled"


@pytest.mark.parametrize("refusal", ["guard", "digest", "decided", "missing"])
async def test_a_refused_decision_writes_nothing(store, refusal: str) -> None:
    run = await _run_in(store, "waiting_input")
    action, approval = await waiting_action(store, run)
    if refusal == "decided":
        await store.decide_approval(approval["id"], "rejected", "op-0")
    before = (await _head(store, run["id"]), await store.get_approval(approval["id"]))

    def guard(owner: str, risk: str) -> None:
        assert (owner, risk) == ("u1", action["risk_level"])
        raise PermissionError("not yours")

    kwargs: dict = {"run_status": "running"}
    approval_id = "no-such-approval" if refusal == "missing" else approval["id"]
    if refusal == "guard":
        kwargs["guard"] = guard
    if refusal == "digest":
        kwargs["arguments_digest"] = "not-the-digest"
    expected = {
        "guard": PermissionError,
        "digest": ConflictError,
        "decided": ConflictError,
        "missing": NotFoundError,
    }[refusal]
    with pytest.raises(expected):
        await store.decide_approval(approval_id, "approved", "op-1", **kwargs)
    assert (await _head(store, run["id"]), await store.get_approval(approval["id"])) == before
    assert (await store.get_run(run["id"]))["status"] == "waiting_input"


async def test_a_late_decision_expires_and_logs_the_expiry_once(store) -> None:
    run = await _run_in(store, "waiting_input")
    action, approval = await waiting_action(store, run)
    await make_overdue(store, approval["id"])
    with pytest.raises(ConflictError, match="expired before the decision"):
        await store.decide_approval(approval["id"], "approved", "op-1", run_status="running")
    expired = await store.get_approval(approval["id"])
    assert expired["status"] == "expired" and expired["decided_by"] is None
    stored = await store.get_action(action["id"])
    assert stored["status"] == "rejected" and stored["finished_at"] is not None
    events = await store.list_events(run["id"])
    assert [e["event_type"] for e in events[-2:]] == ["approval.expired", "action.rejected"]
    assert events[-1]["payload"]["reason"] == "approval_expired"
    assert await store.verify_audit_chain(run["id"])
    # An expiry is not a decision: the run is left where it was.
    assert (await store.get_run(run["id"]))["status"] == "waiting_input"
    async with store.db.reader() as session:
        row = await session.get(ApprovalRow, approval["id"])
        assert row is not None and row.status == "expired"


async def _lease(store, action_id: str) -> dict | None:
    async with store.db.reader() as session:
        row = (
            await session.execute(
                select(ActionLeaseRow).where(ActionLeaseRow.action_id == action_id)
            )
        ).scalar_one_or_none()
        return None if row is None else {"token": row.fencing_token, "until": row.lease_expires_at}


async def _claimed(store, key: str = "w") -> tuple[dict, dict, int]:
    run = await new_run(store)
    action = await new_action(store, run, key=key, target_key=target_for(key))
    claim = await store.claim_for_execution(action["id"], 30)
    return run, action, claim.action["fencing_token"]


async def test_an_outcome_leaves_the_action_the_log_and_the_target_as_its_rules_say(
    store,
) -> None:
    run, action, token = await _claimed(store)
    told: list = []
    store.db.observers.append(told.extend)
    assert await store.record_action_terminal_result(
        action["id"],
        "failed",
        {"error_code": "refused", "detail": "no"},
        fencing_token=token,
        external_object_id="T-\x00-7",
        attempt_over=True,
    )
    stored = await store.get_action(action["id"])
    assert stored["status"] == "failed" and stored["finished_at"] is not None
    assert stored["result"] == {"error_code": "refused", "detail": "no"}
    assert "\x00" not in stored["external_object_id"] and "7" in stored["external_object_id"]
    assert await _lease(store, action["id"]) is None  # a definite outcome frees the target
    events = await store.list_events(run["id"])
    assert events[-1]["event_type"] == "action.failed"
    assert events[-1]["payload"] == {
        "action_id": action["id"],
        "fencing_token": token,
        "error_code": "refused",
    }
    assert await store.verify_audit_chain(run["id"])
    assert await _head(store, run["id"]) == (events[-1]["seq"], events[-1]["hash"])
    assert ActionEnded(stored["tool_name"], "failed") in told


async def test_an_unknown_outcome_keeps_the_target_and_stops_the_lease_clock_when_over(
    store,
) -> None:
    run, action, token = await _claimed(store)
    live = await _lease(store, action["id"])
    assert await store.record_action_terminal_result(
        action["id"], "unknown", {"error_code": "timeout"}, fencing_token=token, attempt_over=True
    )
    stopped = await _lease(store, action["id"])
    assert stopped is not None and stopped["token"] == token  # the target stays blocked
    assert stopped["until"] < live["until"]  # and reconcilable at once
    assert (await store.get_action(action["id"]))["status"] == "unknown"
    assert (await store.list_events(run["id"]))[-1]["event_type"] == "action.unknown"


@pytest.mark.parametrize("refusal", ["token", "finished", "missing"])
async def test_an_outcome_that_is_not_the_attempts_to_record_writes_nothing(
    store, refusal: str
) -> None:
    run, action, token = await _claimed(store)
    if refusal == "finished":
        assert await store.record_action_terminal_result(
            action["id"], "succeeded", {}, fencing_token=token
        )
    before = (
        await _head(store, run["id"]),
        await store.get_action(action["id"]),
        await _lease(store, action["id"]),
    )
    if refusal == "missing":
        with pytest.raises(NotFoundError):
            await store.record_action_terminal_result("no-such-action", "succeeded", {})
    else:
        wrong = token + 1 if refusal == "token" else token
        assert not await store.record_action_terminal_result(
            action["id"], "failed", {"error_code": "late"}, fencing_token=wrong
        )
    after = (
        await _head(store, run["id"]),
        await store.get_action(action["id"]),
        await _lease(store, action["id"]),
    )
    assert after == before


async def test_a_decision_tells_the_metrics_once_committed(store) -> None:
    run = await _run_in(store, "waiting_input")
    _, approval = await waiting_action(store, run)
    told: list = []
    store.db.observers.append(told.extend)
    await store.decide_approval(approval["id"], "rejected", "op-1")
    assert [type(n) for n in told] == [ApprovalSettled, ActionEnded]
    assert told[0].outcome == "rejected" and told[1].status == "rejected"
    told.clear()
    with pytest.raises(ConflictError):
        await store.decide_approval(approval["id"], "approved", "op-1")
    assert told == []  # a refused decision commits nothing and tells nothing
