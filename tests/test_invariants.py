"""The invariant checker catches each way the promise can break: fed a clean
history it finds nothing; fed one broken on purpose, it names the rule."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from roundtable.invariants import Evidence, check, summary

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def event(kind: str, **payload: Any) -> dict[str, Any]:
    return {"event_type": kind, "payload": payload}


def clean() -> Evidence:
    """Two runs: one wrote T-1 twice in turn (approved, then auto), one had its
    approval expire; one write ended unknown and was reconciled succeeded."""
    actions = [
        {
            "id": "a1",
            "run_id": "r1",
            "idempotency_key": "k1",
            "tool_name": "ticket_update",
            "status": "succeeded",
            "target_scope": "scope:tickets",
            "result": {},
        },
        {
            "id": "a2",
            "run_id": "r1",
            "idempotency_key": "k2",
            "tool_name": "ticket_comment",
            "status": "succeeded",
            "target_scope": "scope:tickets",
            "result": {"reconciled_outcome": "succeeded"},
        },
        {
            "id": "a3",
            "run_id": "r2",
            "idempotency_key": "k3",
            "tool_name": "ticket_close",
            "status": "rejected",
            "target_scope": "scope:tickets",
            "result": {"error_code": "approval_expired"},
        },
    ]
    approvals = [
        {"id": "p1", "run_id": "r1", "action_id": "a1", "status": "approved"},
        {"id": "p3", "run_id": "r2", "action_id": "a3", "status": "expired"},
    ]
    events = {
        "r1": [
            event("action.created", action_id="a1"),
            event("approval.requested", approval_id="p1", action_id="a1"),
            event("approval.approved", approval_id="p1", action_id="a1"),
            event("action.approved", approval_id="p1", action_id="a1"),
            event("action.executing", action_id="a1"),
            event("action.succeeded", action_id="a1"),
            event("action.created", action_id="a2"),
            event("action.executing", action_id="a2"),
            event("action.unknown", action_id="a2"),
            event("action.reconciled", action_id="a2", outcome="succeeded"),
        ],
        "r2": [
            event("action.created", action_id="a3"),
            event("approval.requested", approval_id="p3", action_id="a3"),
            event("approval.expired", approval_id="p3", action_id="a3"),
            event("action.rejected", approval_id="p3", action_id="a3"),
        ],
    }
    writes = [
        {
            "idempotency_key": "k1",
            "fencing_token": 1,
            "tenant_id": "acme",
            "ticket_id": "T-1",
            "started_at": at(0),
            "finished_at": at(1),
            "outcome": "applied",
        },
        {
            "idempotency_key": "k2",
            "fencing_token": 2,
            "tenant_id": "acme",
            "ticket_id": "T-1",
            "started_at": at(2),
            "finished_at": at(3),
            "outcome": "applied",
        },
    ]
    return Evidence(
        runs=[
            {"id": "r1", "status": "completed", "failure": None},
            {"id": "r2", "status": "completed", "failure": None},
        ],
        actions=actions,
        approvals=approvals,
        events=events,
        chains_ok={"r1": True, "r2": True},
        ticket_writes=writes,
        started_runs={"r1", "r2"},
        closed_in_temporal={"r1": True, "r2": True},
    )


def rules_broken(evidence: Evidence) -> set[int]:
    return {v.rule for v in check(evidence)}


def test_a_clean_history_has_no_violations() -> None:
    evidence = clean()
    assert check(evidence) == []
    assert summary(evidence, [], faults=3) == "runs=2 actions=3 faults=3 violations=0"


def test_a_double_write_is_caught() -> None:
    evidence = clean()
    again = {**evidence.ticket_writes[0], "started_at": at(5), "finished_at": at(6)}
    evidence.ticket_writes.append({**again, "fencing_token": 3})
    assert 1 in rules_broken(evidence)


def test_a_repeat_the_ticket_system_absorbed_is_caught() -> None:
    evidence = clean()
    evidence.ticket_writes[0] = {**evidence.ticket_writes[0], "arrivals": 2}
    assert [v.rule for v in check(evidence)] == [1]


def test_two_actions_with_one_key_are_caught() -> None:
    evidence = clean()
    evidence.actions.append({**evidence.actions[0], "id": "a9"})
    assert 1 in rules_broken(evidence)


def test_overlapping_writes_are_caught() -> None:
    evidence = clean()
    evidence.ticket_writes[1]["started_at"] = at(0.5)  # before the first one finished
    assert rules_broken(evidence) == {2}


def test_a_write_still_open_overlaps_everything_after_it() -> None:
    evidence = clean()
    evidence.ticket_writes[0]["finished_at"] = None
    assert 2 in rules_broken(evidence)


def test_an_overlap_with_a_long_earlier_write_is_caught() -> None:
    evidence = clean()
    long_one = evidence.ticket_writes[0]
    long_one["finished_at"] = at(10)
    short = {**evidence.ticket_writes[1], "idempotency_key": "k2", "started_at": at(2)}
    evidence.ticket_writes[1] = short
    assert 2 in rules_broken(evidence)


def test_a_token_going_backwards_is_caught() -> None:
    evidence = clean()
    evidence.ticket_writes[1]["fencing_token"] = 1
    assert rules_broken(evidence) == {2}


def test_a_write_refused_by_the_fence_is_no_violation() -> None:
    """A frozen worker's late write, refused by the fencing token: the fence
    did its job, and the log keeps the refusal."""
    evidence = clean()
    evidence.ticket_writes.append(
        {
            "idempotency_key": "k-late",
            "fencing_token": 1,
            "tenant_id": "acme",
            "ticket_id": "T-1",
            "started_at": at(0.2),
            "finished_at": at(2.5),
            "outcome": "rejected_stale",
        }
    )
    assert check(evidence) == []


def test_an_action_left_executing_without_a_lease_is_caught() -> None:
    evidence = clean()
    evidence.actions[0]["status"] = "executing"
    assert any("without a live lease" in str(v) for v in check(evidence))
    evidence.live_leases = {"a1"}
    assert not any("without a live lease" in str(v) for v in check(evidence))


def test_an_action_left_approved_in_a_finished_run_is_caught() -> None:
    evidence = clean()
    evidence.actions[0]["status"] = "approved"
    assert 3 in rules_broken(evidence)


def test_a_success_the_ticket_never_saw_is_caught() -> None:
    evidence = clean()
    del evidence.ticket_writes[1]
    assert 4 in rules_broken(evidence)


def test_a_write_reconciled_failed_that_happened_is_caught() -> None:
    evidence = clean()
    evidence.actions[1]["status"] = "failed"  # the operator guessed wrong
    assert 4 in rules_broken(evidence)


def test_an_unknown_write_that_applied_is_no_violation_yet() -> None:
    evidence = clean()
    evidence.actions[1]["status"] = "unknown"
    evidence.actions[1]["result"] = {}
    evidence.events["r1"] = evidence.events["r1"][:-1]
    evidence.runs[0]["status"] = "waiting_input"
    evidence.closed_in_temporal = {"r1": False, "r2": True}
    assert check(evidence) == []


def test_an_approval_decided_twice_is_caught() -> None:
    evidence = clean()
    evidence.events["r1"].append(event("approval.rejected", approval_id="p1", action_id="a1"))
    assert 5 in rules_broken(evidence)


def test_an_approval_whose_action_disagrees_is_caught() -> None:
    evidence = clean()
    evidence.approvals[1]["status"] = "approved"
    evidence.events["r2"][2] = event("approval.approved", approval_id="p3", action_id="a3")
    assert 5 in rules_broken(evidence)


def test_a_broken_chain_is_caught() -> None:
    evidence = clean()
    evidence.chains_ok = {"r1": True, "r2": False}
    assert rules_broken(evidence) == {6}


def test_a_state_change_without_its_event_is_caught() -> None:
    evidence = clean()
    evidence.events["r1"] = [
        e for e in evidence.events["r1"] if e["event_type"] != "action.succeeded"
    ]
    assert rules_broken(evidence) == {6}


def test_a_lost_run_is_caught() -> None:
    evidence = clean()
    evidence.started_runs = {"r1", "r2", "r3"}
    assert rules_broken(evidence) == {7}


def test_a_run_waiting_for_nothing_is_caught() -> None:
    evidence = clean()
    evidence.runs[1]["status"] = "waiting_input"
    evidence.closed_in_temporal = None
    assert rules_broken(evidence) == {7}


def test_store_and_temporal_disagreeing_is_caught() -> None:
    evidence = clean()
    evidence.closed_in_temporal = {"r1": True, "r2": False}
    assert rules_broken(evidence) == {7}


def test_every_violation_names_its_subject() -> None:
    evidence = clean()
    evidence.ticket_writes[1]["fencing_token"] = 1
    assert [str(v) for v in check(evidence)] == [
        "rule 2 · acme/T-1: fencing token went from 1 to 1",
        "rule 2 · scope:tickets: fencing token 1 was accepted 2 times",
    ]
