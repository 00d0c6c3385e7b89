"""The chaos run's judgement of the runs its operator bot recovered.

The bot resets a run the sweep calls stalled (roundtable/recovery.py), as an
operator would, so that the run still settles and every invariant is checked
on it. But a recovery means a history this code could not replay, which is
the very bug class the chaos run exists to catch. So each one is judged: the
known finding (a worker that took the run over after a timed-out workflow
task split its activations, tests/histories_nondeterministic/README.md) is
reported as a note, with the stalled history kept; any other divergence is a
violation, so a new nondeterminism still fails the run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHistory

from roundtable.store import Store

COMPLETED = EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
TIMED_OUT = EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT


def after_a_timed_out_task(history: WorkflowHistory, completed_at: int) -> bool:
    """Whether the task completed at event ``completed_at`` took the run over
    from a task that timed out since the task completed before it: the
    known finding's shape."""
    since_last = False
    for event in history.events:
        if event.event_id >= completed_at:
            return since_last
        if event.event_type == COMPLETED:
            since_last = False
        elif event.event_type == TIMED_OUT:
            since_last = True
    return False


async def judge(
    store: Store, temporal: Client | None, run_ids: set[str], keep_in: Path
) -> tuple[list[str], list[str]]:
    """``(notes, violations)`` for every recovery of these runs; each stalled
    execution's history is kept in ``keep_in`` to be studied."""
    notes: list[str] = []
    violations: list[str] = []
    for run_id in sorted(run_ids):
        events = await store.list_events(run_id)
        begun: dict[str, dict[str, Any]] = {
            e["payload"]["from_execution"]: e["payload"]
            for e in events
            if e["event_type"] == "run.recovery_begun"
        }
        for event in events:
            if event["event_type"] != "run.recovered":
                continue
            execution = event["payload"]["from_execution"]
            reset_to = int(begun[execution]["reset_to_event"])
            if temporal is None:
                violations.append(f"recovered {run_id}: no Temporal client to judge it with")
                continue
            handle = temporal.get_workflow_handle(run_id, run_id=execution)
            history = await handle.fetch_history()
            kept = keep_in / f"recovered-{run_id}-{execution}.json"
            kept.write_text(history.to_json())
            if after_a_timed_out_task(history, reset_to):
                notes.append(
                    f"recovered {run_id} at event {reset_to}: the known takeover finding "
                    f"(tests/histories_nondeterministic/README.md); history kept as {kept.name}"
                )
            else:
                violations.append(
                    f"recovered {run_id} at event {reset_to}: a divergence not after a "
                    f"timed-out task, so not the known finding; history kept as {kept.name}"
                )
    return notes, violations
