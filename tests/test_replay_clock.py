"""A run's commands never depend on the clock its workflow tasks read.

``workflow.now()`` is the time a workflow task started, and a worker that took
a run over has been seen to read another one: the time of the task before
(tests/histories_nondeterministic/). Whatever the clock decides (a timer armed
or not, a warning sent or not) can then differ between the worker that ran the
task and every worker that replays it, and the run stalls. So every history
recorded since timers alone decide an approval's times is replayed here with
its tasks' clocks moved: held at the task before, held at the run's start,
pushed years ahead. Replay checks commands, not timer durations, so only a
command the clock chose can fail it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from roundtable.temporal import data_converter
from workflows.roundtable import RoundtableWorkflow
from workflows.sweep import SweepWorkflow

RECORDED = Path(__file__).parent / "histories"
# Runs recorded with the approval-times-by-timers patch (workflows/roundtable.py).
TIMER_DECIDED = {
    path.stem: path.read_text()
    for path in sorted((RECORDED / "recorded-with-timer-decisions").glob("*.json"))
}
# A run from before the patch, where the clock chose whether to arm a timer.
CLOCK_DECIDED = (
    RECORDED / "recorded-with-waking-writes" / "test_approval_expires_on_the_workflow_timer.json"
).read_text()
TASK_STARTED = "EVENT_TYPE_WORKFLOW_TASK_STARTED"

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
    """The history with each workflow task's start time (its workflow.now())
    replaced as ``shift`` says."""
    history = json.loads(text)
    started = [e for e in history["events"] if e["eventType"] == TASK_STARTED]
    moved = shift([_parse(e["eventTime"]) for e in started])
    for event, moment in zip(started, moved, strict=True):
        event["eventTime"] = _render(moment)
    return json.dumps(history)


async def _replay_failure(name: str, text: str) -> Exception | None:
    replayer = Replayer(
        workflows=[RoundtableWorkflow, SweepWorkflow], data_converter=data_converter()
    )
    history = WorkflowHistory.from_json(name, text)
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    return result.replay_failure


def test_runs_with_approval_waits_are_recorded() -> None:
    """Without them the test below proves nothing: the histories must hold
    approvals that waited, warned, expired and were extended."""
    assert {
        "test_approved_write_executes_once",
        "test_approval_expires_on_the_workflow_timer",
        "test_an_extended_approval_outlives_its_first_deadline",
        "test_approval_lifecycle_webhooks_are_signed_retried_and_logged",
        "test_a_warning_lead_longer_than_the_approval_warns_at_once",
    } <= set(TIMER_DECIDED)


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
