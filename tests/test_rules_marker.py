"""A run started on today's code asks for one patch, the marker that stands
for every rule the older patches brought in (workflows/roundtable.py,
CURRENT_RULES_PATCH), instead of asking for each: each patch a run asks for
is a marker, an upsert of TemporalChangeVersion and two of the SDK core's
state machines kept while the run is cached. Under the same patch the run
opens with a local activity instead of an activity and the task after it,
and that opening moves it to running (no status write of its own).
Runs recorded before it still ask for each patch and schedule the activity
(tests/test_replay.py replays them)."""

from __future__ import annotations

import json
from pathlib import Path

from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowHistory

from roundtable.names import RUN_WORKFLOW
from tests.test_workflow_approvals import decide, one_write
from tests.workflow_harness import harness
from workflows.roundtable import CURRENT_RULES_PATCH

PATCH_MARKER = "core_patch"
LOCAL = "core_local_activity"
VERSION_ATTRIBUTE = "TemporalChangeVersion"
RECORDED = Path(__file__).parent / "histories"


def patches_asked(events: list[HistoryEvent]) -> list[str]:
    """The patch ids a run recorded markers for, in order."""
    asked = []
    for event in events:
        if not event.HasField("marker_recorded_event_attributes"):
            continue
        marker = event.marker_recorded_event_attributes
        if marker.marker_name == PATCH_MARKER:
            asked.append(json.loads(marker.details["patch-data"].payloads[0].data)["id"])
    return asked


def local_activities(events: list[HistoryEvent]) -> list[str]:
    """The local activities a run recorded, in order."""
    done = []
    for event in events:
        marker = event.marker_recorded_event_attributes
        if event.HasField("marker_recorded_event_attributes") and marker.marker_name == LOCAL:
            done.append(json.loads(marker.details["data"].payloads[0].data)["activity_type"])
    return done


def scheduled_activities(events: list[HistoryEvent]) -> list[str]:
    return [
        event.activity_task_scheduled_event_attributes.activity_type.name
        for event in events
        if event.HasField("activity_task_scheduled_event_attributes")
    ]


def version_upserts(events: list[HistoryEvent]) -> int:
    return sum(
        VERSION_ATTRIBUTE
        in event.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
        for event in events
        if event.HasField("upsert_workflow_search_attributes_event_attributes")
    )


async def test_a_new_run_asks_for_one_patch(tmp_path) -> None:
    async with harness(tmp_path) as h:
        handle = await h.start(task_text="raise priority", script=one_write())
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        assert await decide(handle, approval_id, "approved") == "approved"
        assert (await handle.result()).status == "completed"
        events = list((await handle.fetch_history()).events)
    assert patches_asked(events) == [CURRENT_RULES_PATCH]
    assert version_upserts(events) == 1
    # The same rules open the run with a local activity, in the first task,
    # which also moves the run to running: no status write of its own before
    # the first turn.
    first_turn = next(
        n for n, event in enumerate(events) if scheduled_activities([event]) == ["take_turn"]
    )
    assert local_activities(events[:first_turn]) == ["ensure_run"]
    assert "ensure_run" not in scheduled_activities(events)


def test_runs_recorded_with_the_marker_ask_for_nothing_else() -> None:
    """Including the runs that reached what used to be asked for late: a write
    blocked behind an unknown (per-write-blocked-reasons) and a run's ending
    (handlers-finish-before-completion)."""
    runs = [
        WorkflowHistory.from_json(path.stem, path.read_text())
        for path in sorted((RECORDED / "recorded-with-one-rules-marker").glob("*.json"))
    ]
    ours = [run for run in runs if _workflow_type(run) == RUN_WORKFLOW]
    assert len(ours) >= 15
    assert {tuple(patches_asked(list(run.events))) for run in ours} == {(CURRENT_RULES_PATCH,)}
    names = {run.workflow_id for run in ours}
    assert {
        "test_target_blocked_by_unknown_waits_for_reconciliation",
        "test_one_writes_end_does_not_erase_anothers_blocked_reason",
    } <= names


def test_runs_recorded_before_it_asked_for_each_patch() -> None:
    """The old path is still there to replay: these runs asked one by one."""
    old = RECORDED / "recorded-with-timer-decisions" / "test_approved_write_executes_once.json"
    run = WorkflowHistory.from_json(old.stem, old.read_text())
    asked = patches_asked(list(run.events))
    assert len(asked) >= 5 and CURRENT_RULES_PATCH not in asked
    assert version_upserts(list(run.events)) == len(asked)
    assert scheduled_activities(list(run.events))[0] == "ensure_run"
    assert local_activities(list(run.events))[0] == "set_run_status"


def _workflow_type(run: WorkflowHistory) -> str:
    return run.events[0].workflow_execution_started_event_attributes.workflow_type.name
