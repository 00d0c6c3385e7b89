"""A run's commands never depend on the clock its workflow tasks read.

``workflow.now()`` is the time a workflow task started, and a worker that took
a run over has been seen to read another one: the time of the task before
(tests/histories_nondeterministic/). Whatever the clock decides (a timer armed
or not, a warning sent or not) can then differ between the worker that ran the
task and every worker that replays it, and the run stalls. So every history
recorded since timers alone decide an approval's times is replayed here with
its clocks moved: held at the task before, held at the run's start, pushed
years ahead. Replay checks commands, not timer durations, so only a command
the clock chose can fail it.

The SDK's core keeps the workflow clock from going backwards and, once a
local activity resolves, sets it to the completion time recorded in the
activity's marker; every approval wait follows a local activity in its task.
So the markers' times move with their tasks' (the review of this check found
that moving task start times alone left 11 of 13 waits reading the clock they
read unmoved), and a test here requires every wait to read a moved clock.
"""

from __future__ import annotations

import ast
import base64
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from temporalio import workflow
from temporalio.client import WorkflowHistory

import workflows.approval_clock as approval_clock
from roundtable.workflow_runner import workflow_runner
from tests.replaying import replay_failure

RECORDED = Path(__file__).parent / "histories"
# Runs recorded with the approval-times-by-timers patch (workflows/roundtable.py),
# asked for on its own or, since, through the one marker for every rule.
TIMER_DECIDED = {
    f"{path.parent.name}/{path.stem}": path.read_text()
    for directory in ("recorded-with-timer-decisions", "recorded-with-one-rules-marker")
    for path in sorted((RECORDED / directory).glob("*.json"))
}
# A run from before the patch, where the clock chose whether to arm a timer.
CLOCK_DECIDED = (
    RECORDED / "recorded-with-waking-writes" / "test_approval_expires_on_the_workflow_timer.json"
).read_text()
TASK_STARTED = "EVENT_TYPE_WORKFLOW_TASK_STARTED"
LOCAL_ACTIVITY_MARKER = "core_local_activity"

Shift = Callable[[list[datetime]], list[datetime]]


def _stale(times: list[datetime]) -> list[datetime]:
    """Each task reads the clock of the task before it, as the worker that
    left tests/histories_nondeterministic/ did."""
    return times[:1] + times[:-1]


def _frozen(times: list[datetime]) -> list[datetime]:
    """The clock never moves from the run's first task."""
    return [times[0]] * len(times)


def _years_ahead(times: list[datetime]) -> list[datetime]:
    """Every task after the first reads a clock ten years ahead: every
    deadline and warning looks past."""
    return times[:1] + [t + timedelta(days=3650) for t in times[1:]]


SHIFTS: dict[str, Shift] = {"stale": _stale, "frozen": _frozen, "years-ahead": _years_ahead}


def _parse(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _render(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def with_clocks(text: str, shift: Shift) -> str:
    """The history with each workflow task's start time replaced as ``shift``
    says, and each local activity's recorded completion time (the clock the
    SDK's core sets once the activity resolves) moved with the task that
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
        if not marker or marker["markerName"] != LOCAL_ACTIVITY_MARKER:
            continue
        payload = marker["details"]["data"]["payloads"][0]
        data = json.loads(base64.b64decode(payload["data"]))
        done = data["complete_time"]
        recorded = datetime.fromtimestamp(done["seconds"], UTC) + timedelta(
            microseconds=done.get("nanos", 0) // 1000
        )
        at = moved[task] + (recorded - times[task]) if shift is _years_ahead else moved[task]
        data["complete_time"] = {"seconds": int(at.timestamp()), "nanos": at.microsecond * 1000}
        payload["data"] = base64.b64encode(json.dumps(data).encode()).decode()
    return json.dumps(history)


async def _replay_failure(name: str, text: str) -> Exception | None:
    return await replay_failure(WorkflowHistory.from_json(name, text), workflow_runner())


def test_runs_with_approval_waits_are_recorded() -> None:
    """Without them the test below proves nothing: the histories must hold
    approvals that waited, warned, expired and were extended."""
    waits = {
        "test_approved_write_executes_once",
        "test_approval_expires_on_the_workflow_timer",
        "test_an_extended_approval_outlives_its_first_deadline",
        "test_approval_lifecycle_webhooks_are_signed_retried_and_logged",
    }
    # The warning-lead test's name changed between the two recordings.
    for directory, warns in (
        (
            "recorded-with-timer-decisions",
            "test_a_warning_lead_longer_than_the_approval_warns_at_once",
        ),
        (
            "recorded-with-one-rules-marker",
            "test_a_past_warning_goes_out_in_a_later_task_after_a_timer",
        ),
    ):
        assert {f"{directory}/{name}" for name in (*waits, warns)} <= set(TIMER_DECIDED)


async def _clocks_at_waits(monkeypatch: pytest.MonkeyPatch, name: str, text: str) -> list[datetime]:
    """workflow.now() at each ApprovalClock.wait as ``text`` replays."""
    seen: list[datetime] = []
    original = approval_clock.ApprovalClock.wait

    async def wait(self, woken):  # type: ignore[no-untyped-def]
        seen.append(workflow.now())
        return await original(self, woken)

    with monkeypatch.context() as patched:
        patched.setattr(approval_clock.ApprovalClock, "wait", wait)
        assert await _replay_failure(name, text) is None
    return seen


@pytest.mark.parametrize("shift", SHIFTS)
async def test_each_shift_moves_the_clock_every_approval_wait_reads(
    monkeypatch: pytest.MonkeyPatch, shift: str
) -> None:
    """Without this, a shift that moved nothing would pass the test below."""
    unmoved: list[tuple[str, datetime]] = []
    waits = 0
    for name, text in TIMER_DECIDED.items():
        before = await _clocks_at_waits(monkeypatch, name, text)
        after = await _clocks_at_waits(monkeypatch, name, with_clocks(text, SHIFTS[shift]))
        assert len(before) == len(after)
        waits += len(before)
        unmoved += [(name, b) for b, a in zip(before, after, strict=True) if b == a]
    assert waits >= 10
    assert unmoved == [], f"{len(unmoved)} of {waits} waits read an unmoved clock"


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("name", TIMER_DECIDED)
async def test_a_recorded_run_replays_whatever_clock_its_tasks_read(name: str, shift: str) -> None:
    text = with_clocks(TIMER_DECIDED[name], SHIFTS[shift])
    assert await _replay_failure(name, text) is None


async def test_a_run_from_before_the_patch_shows_the_clock_deciding() -> None:
    """The check has teeth: a run recorded before timers alone decided still
    replays on the old path, where the clock chose whether to arm the
    deadline's timer, and a clock years ahead breaks it."""
    name = "test_approval_expires_on_the_workflow_timer"
    assert await _replay_failure(name, CLOCK_DECIDED) is None
    failure = await _replay_failure(name, with_clocks(CLOCK_DECIDED, _years_ahead))
    assert failure is not None
    assert "ondeterminism" in str(failure)


# Where workflows/ reads workflow.now() today, and why none of them chooses a
# command on the patched path: a new reading must be looked at (and, if it
# chooses a command, gated and checked here). From the review of this check.
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
