"""Review of the approval-times-decided-by-timers change (de90244): how much
its tests can see.

1. Moving WorkflowTaskStarted times does not move every clock a run reads.
   Core keeps the workflow clock monotonic and sets it, after a local
   activity resolves, to that activity's recorded completion time (the
   marker's ``complete_time``: core's ``UpdateWFTime``). Every approval wait
   follows a local activity in its task (the intercept, a status check, an
   expiry), so under "stale" and "frozen" most waits read exactly the clock
   they read unperturbed: the check with teeth is "years-ahead" alone.
   ``with_all_clocks`` moves the markers' times too; with it every wait reads
   a moved clock, and the recorded runs still replay.

2. test_webhooks.py::test_a_warning_lead_longer_than_the_approval_warns_at_once
   tells the fix from its absence only through the order in which two
   concurrent deliveries reach the receiver: with the patch reverted it still
   passes about two times in three. The history says it for certain: the
   warning goes out in a later task, after a timer fired.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from temporalio import workflow
from temporalio.api.enums.v1 import EventType

import workflows.approval_clock as approval_clock
from tests.test_replay_clock import (
    SHIFTS,
    TASK_STARTED,
    TIMER_DECIDED,
    Shift,
    _parse,
    _render,
    _replay_failure,
    _years_ahead,
    with_clocks,
)
from tests.test_webhooks import receiver, with_webhooks
from tests.workflow_harness import harness, script, ticket_call

LA_MARKER = "core_local_activity"


def with_all_clocks(text: str, shift: Shift) -> str:
    """``with_clocks``, and each local activity marker's completion time (the
    clock core sets once the activity resolves) moved with the task that
    recorded it: to the task's moved start, or, years ahead, by as much."""
    history = json.loads(text)
    started = [e for e in history["events"] if e["eventType"] == TASK_STARTED]
    times = [_parse(e["eventTime"]) for e in started]
    moved = shift(times)
    task = -1
    for event in history["events"]:
        if event["eventType"] == TASK_STARTED:
            task += 1
            event["eventTime"] = _render(moved[task])
        marker = event.get("markerRecordedEventAttributes")
        if not marker or marker["markerName"] != LA_MARKER:
            continue
        payload = marker["details"]["data"]["payloads"][0]
        data = json.loads(base64.b64decode(payload["data"]))
        done = data["complete_time"]
        recorded = datetime.fromtimestamp(done["seconds"], UTC) + timedelta(
            microseconds=done.get("nanos", 0) // 1000
        )
        at = moved[task] + (recorded - times[task]) if shift is _years_ahead else moved[task]
        seconds = int(at.timestamp())
        data["complete_time"] = {"seconds": seconds, "nanos": at.microsecond * 1000}
        payload["data"] = base64.b64encode(json.dumps(data).encode()).decode()
    return json.dumps(history)


async def _clocks_at_waits(monkeypatch: pytest.MonkeyPatch, name: str, text: str) -> list[datetime]:
    """workflow.now() at each ApprovalClock.wait when ``text`` replays."""
    seen: list[datetime] = []
    original = approval_clock.ApprovalClock.wait

    async def wait(self, woken):  # type: ignore[no-untyped-def]
        seen.append(workflow.now())
        return await original(self, woken)

    with monkeypatch.context() as patched:
        patched.setattr(approval_clock.ApprovalClock, "wait", wait)
        assert await _replay_failure(name, text) is None
    return seen


MOVERS: dict[str, Callable[[str, Shift], str]] = {
    "with_clocks": with_clocks,
    "with_all_clocks": with_all_clocks,
}


@pytest.mark.parametrize("mover", MOVERS)
@pytest.mark.parametrize("shift", SHIFTS)
async def test_each_shift_moves_the_clock_every_approval_wait_reads(
    monkeypatch: pytest.MonkeyPatch, shift: str, mover: str
) -> None:
    """Fails for with_clocks under "stale" and "frozen" (tests/test_replay_clock.py):
    11 of the 13 waits in recorded-with-timer-decisions/ read the very clock
    they read unperturbed."""
    unmoved: list[tuple[str, datetime, datetime]] = []
    waits = 0
    for name, text in TIMER_DECIDED.items():
        before = await _clocks_at_waits(monkeypatch, name, text)
        after = await _clocks_at_waits(monkeypatch, name, MOVERS[mover](text, SHIFTS[shift]))
        assert len(before) == len(after)
        waits += len(before)
        unmoved += [(name, b, a) for b, a in zip(before, after, strict=True) if b == a]
    assert waits >= 10
    assert unmoved == [], f"{len(unmoved)} of {waits} waits read an unmoved clock"


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("name", TIMER_DECIDED)
async def test_a_recorded_run_replays_with_every_clock_moved(name: str, shift: str) -> None:
    """The change holds under the stronger perturbation too."""
    assert await _replay_failure(name, with_all_clocks(TIMER_DECIDED[name], SHIFTS[shift])) is None


async def test_a_past_warning_goes_out_in_a_later_task_after_a_timer(tmp_path) -> None:
    """What test_a_warning_lead_longer_than_the_approval_warns_at_once means
    to show, read from the history rather than from the order two concurrent
    deliveries happen to reach the receiver: the warning is not sent in the
    task that asks for the approval (the clock's say), but after a timer
    fires; and the expiry comes no earlier than the approval's deadline."""
    async with (
        receiver() as hook,
        harness(tmp_path, worker_factory=with_webhooks(hook.url, lead=300)) as h,
    ):
        handle = await h.start(
            task_text="t",
            approval_timeout_seconds=60,
            script=script(("seat-1", 1, [ticket_call("ticket_update")])),
        )
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        assert (await h.result(handle)).status == "completed"
        assert sorted(hook.events()) == sorted(
            ["approval.requested", "approval.expiring", "run.completed"]
        )

        events = [e async for e in handle.fetch_history_events()]
        webhooks = [
            i
            for i, e in enumerate(events)
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
            and e.activity_task_scheduled_event_attributes.activity_type.name == "deliver_webhook"
        ]
        requested, warned = webhooks[0], webhooks[1]
        between = {e.event_type for e in events[requested:warned]}
        assert EventType.EVENT_TYPE_TIMER_FIRED in between
        assert EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED in between

        approval = await h.store.get_approval(approval_id)
        assert approval["status"] == "expired"
        last_started = None
        for event in events:
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
                last_started = event.event_time.ToDatetime(tzinfo=UTC)
            marker = event.marker_recorded_event_attributes
            if (
                event.event_type == EventType.EVENT_TYPE_MARKER_RECORDED
                and marker.marker_name == LA_MARKER
                and b"expire_approval" in marker.details["data"].payloads[0].data
            ):
                assert last_started is not None
                assert last_started >= approval["expires_at"]
                break
        else:
            raise AssertionError("no expiry in the history")


# Where workflows/ reads workflow.now() today, and why none of them chooses a
# command on the patched path: a new reading must be looked at (and, if it
# chooses a command, gated and perturbed in tests/test_replay_clock.py).
CLOCK_READS = {
    # a timer's length only; the old path (no patch) also decides by it
    ("approval_clock.py", "ApprovalClock.warning_due"),
    ("approval_clock.py", "ApprovalClock.wait"),
    # inputs of (local) activities: recorded, never compared on replay
    ("roundtable.py", "RoundtableWorkflow._tool_call"),
    ("roundtable.py", "RoundtableWorkflow._intercept.attempt"),
    ("notifier.py", "Notifier.notify"),
}


def _clock_reads() -> set[tuple[str, str]]:
    import ast
    from pathlib import Path

    found: set[tuple[str, str]] = set()
    for path in sorted((Path(__file__).resolve().parent.parent / "workflows").glob("*.py")):

        def visit(node: ast.AST, where: list[str], path: Path = path) -> None:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                where = [*where, node.name]
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in {"now", "time", "time_ns"}
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "workflow"
            ):
                found.add((path.name, ".".join(where)))
            for child in ast.iter_child_nodes(node):
                visit(child, where)

        visit(ast.parse(path.read_text()), [])
    return found


def test_the_workflow_clock_is_read_only_where_it_chooses_no_command() -> None:
    assert _clock_reads() == CLOCK_READS
