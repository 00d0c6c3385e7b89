"""bench.approvals.task_waits: the part of decide → workflow result the
server spends holding a workflow task before a worker starts it, read from
a history's events."""

from __future__ import annotations

from temporalio.api.history.v1 import HistoryEvent

from bench.approvals import task_waits

SINCE = 1_796_654_892.0


def _at(event: HistoryEvent, seconds: float) -> HistoryEvent:
    event.event_time.FromNanoseconds(round(seconds * 1e9))
    return event


def scheduled(event_id: int, seconds: float) -> HistoryEvent:
    event = HistoryEvent(event_id=event_id)
    event.workflow_task_scheduled_event_attributes.SetInParent()
    return _at(event, seconds)


def started(event_id: int, scheduled_id: int, seconds: float) -> HistoryEvent:
    event = HistoryEvent(event_id=event_id)
    event.workflow_task_started_event_attributes.scheduled_event_id = scheduled_id
    return _at(event, seconds)


def test_each_task_after_the_decision_counts_from_scheduled_to_started() -> None:
    events = [
        scheduled(2, SINCE - 5.0),  # the run's first task, long before the decision
        started(3, 2, SINCE - 4.0),
        scheduled(18, SINCE + 0.006),  # the update's task
        started(19, 18, SINCE + 0.007),
        scheduled(29, SINCE + 0.034),  # the task after the write, held 31 ms
        started(30, 29, SINCE + 0.065),
    ]
    assert (
        abs(task_waits(events, SINCE) - 0.032) < 1e-5
    )  # timestamps near 1.8e9 s keep microseconds


def test_a_task_scheduled_before_the_decision_is_not_its_wait() -> None:
    events = [scheduled(5, SINCE - 0.010), started(6, 5, SINCE + 0.020)]
    assert task_waits(events, SINCE) == 0.0


def test_a_started_event_pairs_with_its_own_scheduled_event() -> None:
    # A task that timed out is scheduled again; the started event names which.
    events = [
        scheduled(8, SINCE + 0.001),
        scheduled(10, SINCE + 0.050),
        started(11, 10, SINCE + 0.052),
    ]
    assert (
        abs(task_waits(events, SINCE) - 0.002) < 1e-5
    )  # timestamps near 1.8e9 s keep microseconds
