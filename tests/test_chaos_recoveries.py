"""The chaos run tells the known takeover finding from any other divergence
among the runs its operator bot recovered (chaos/recoveries.py)."""

from __future__ import annotations

from pathlib import Path

from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHistory

from chaos.recoveries import after_a_timed_out_task

HERE = Path(__file__).parent
STALLED = (HERE / "histories_nondeterministic" / "chaos-client-4.json").read_text()
PLAIN = next(iter(sorted(HERE.glob("histories/**/test_approved_write_executes_once.json"))))
PLAIN_TEXT = PLAIN.read_text()
COMPLETED = EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED


def test_the_known_finding_is_a_takeover_after_a_timed_out_task() -> None:
    history = WorkflowHistory.from_json("chaos-client-4", STALLED)
    assert after_a_timed_out_task(history, 49)  # its task timed out at event 45
    # The task before it (event 34) and a later one (event 62) were no takeover.
    assert not after_a_timed_out_task(history, 34)
    assert not after_a_timed_out_task(history, 62)


def test_a_divergence_anywhere_else_is_not_the_known_finding() -> None:
    history = WorkflowHistory.from_json("plain", PLAIN_TEXT)
    completions = [e.event_id for e in history.events if e.event_type == COMPLETED]
    assert completions and not any(after_a_timed_out_task(history, c) for c in completions)
