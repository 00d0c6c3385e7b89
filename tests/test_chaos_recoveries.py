"""The chaos run tells the known takeover finding from any other divergence
among the runs its operator bot recovered (chaos/recoveries.py)."""

from __future__ import annotations

from pathlib import Path

from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHistory

from chaos.recoveries import after_a_timed_out_task, judge, the_known_finding
from tests.helpers import new_run
from tests.test_store_recovery_claims import begin

HERE = Path(__file__).parent
STALLED = (HERE / "histories_nondeterministic" / "chaos-client-4.json").read_text()
PLAIN = next(iter(sorted(HERE.glob("histories/**/test_approved_write_executes_once.json"))))
PLAIN_TEXT = PLAIN.read_text()
COMPLETED = EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED


def test_the_known_finding_is_a_takeover_after_a_timed_out_task() -> None:
    history = WorkflowHistory.from_json("chaos-client-4", STALLED)
    assert after_a_timed_out_task(history, 49)  # its task timed out at event 45
    assert the_known_finding(history, 49)  # and its tasks then failed as known
    # The task before it (event 34) and a later one (event 62) were no takeover.
    assert not after_a_timed_out_task(history, 34)
    assert not after_a_timed_out_task(history, 62)


def test_a_takeover_that_failed_otherwise_is_not_the_known_finding() -> None:
    """Found in review: the shape alone would file any divergence at a
    takeover (a frozen worker's, which the chaos run makes on purpose) as known."""
    history = WorkflowHistory.from_json("chaos-client-4", STALLED)
    events = list(history.events)
    for event in events:
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
            failure = event.workflow_task_failed_event_attributes.failure
            failure.message = "[TMPRL1100] Nondeterminism error: Timer machine does not handle this"
    altered = WorkflowHistory("chaos-client-4", events)
    assert after_a_timed_out_task(altered, 49) and not the_known_finding(altered, 49)


def test_a_divergence_anywhere_else_is_not_the_known_finding() -> None:
    history = WorkflowHistory.from_json("plain", PLAIN_TEXT)
    completions = [e.event_id for e in history.events if e.event_type == COMPLETED]
    assert completions and not any(after_a_timed_out_task(history, c) for c in completions)


async def test_claims_never_ended_and_recoveries_without_one_are_violations(
    store, tmp_path
) -> None:
    run = await new_run(store)
    await begin(store, run)
    await store.end_recovery(
        run["id"], claim="no-such-claim", from_execution="exec-0", to_execution="exec-9"
    )
    notes, violations = await judge(store, None, {run["id"]}, tmp_path)
    assert notes == []
    assert len(violations) == 2
    assert "begun (recovery:exec-1:0) but never ended" in violations[0]
    assert "with no claim" in violations[1]
