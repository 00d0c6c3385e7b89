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

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHistory

from roundtable.store import Store

COMPLETED = EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
ENDINGS = ("run.recovered", "run.recovery_failed")
TIMED_OUT = EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT
FAILED = EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED


# How the known finding fails its replay: the two coroutines' commands take
# each other's sequence numbers (chaos-client-4).
KNOWN_FAILURE = "does not match activity id of activity command"


def the_known_finding(history: WorkflowHistory, completed_at: int) -> bool:
    """A reset to a task that took the run over from a timed-out task, in a
    history whose tasks then failed as the known finding's did."""
    failures = [
        e.workflow_task_failed_event_attributes.failure.message
        for e in history.events
        if e.event_type == FAILED and e.event_id > completed_at
    ]
    return after_a_timed_out_task(history, completed_at) and any(
        KNOWN_FAILURE in message for message in failures
    )


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
    execution's history is kept in ``keep_in`` to be studied. A claim that
    never ended (a crash between it and the reset's end) is a violation too:
    its reset may have happened unjudged."""
    notes: list[str] = []
    violations: list[str] = []
    for run_id in sorted(run_ids):
        events = await store.list_events(run_id)
        begun = {
            e["dedupe_key"]: e["payload"] for e in events if e["event_type"] == "run.recovery_begun"
        }
        ended = {e["payload"].get("claim") for e in events if e["event_type"] in ENDINGS}
        for claim in sorted(set(begun) - ended):
            violations.append(f"recovery of {run_id} begun ({claim}) but never ended")
        for event in events:
            if event["event_type"] != "run.recovered":
                continue
            claimed = begun.get(event["payload"].get("claim"))
            if claimed is None:
                violations.append(f"recovered {run_id} with no claim: {event['payload']}")
                continue
            execution, reset_to = claimed["from_execution"], int(claimed["reset_to_event"])
            if temporal is None:
                violations.append(f"recovered {run_id}: no Temporal client to judge it with")
                continue
            handle = temporal.get_workflow_handle(run_id, run_id=execution)
            history = await handle.fetch_history()
            kept = keep_in / f"recovered-{run_id}-{execution}.json"
            kept.write_text(history.to_json())
            if the_known_finding(history, reset_to):
                notes.append(
                    f"recovered {run_id} at event {reset_to}: the known takeover finding "
                    f"(tests/histories_nondeterministic/README.md); history kept as {kept.name}"
                )
            else:
                violations.append(
                    f"recovered {run_id} at event {reset_to}: not the known takeover finding; "
                    f"history kept as {kept.name}"
                )
    return notes, violations
