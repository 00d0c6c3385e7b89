"""Where a stalled run is reset: the first workflow task whose commands this
code does not make again (roundtable/recovery.py), found on real histories."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowHistory

from chaos.stack import SECRET
from roundtable.codec import DEFAULT_KEY_ID, EncryptionCodec, derive_payload_key
from roundtable.recovery import (
    MACHINES_REFUSED,
    NONDETERMINISTIC,
    NOT_RECORDED,
    TIMING_OUT,
    NotRecoverableError,
    first_divergent_task,
    not_stalled_by_divergence,
)
from roundtable.states import STALLED_AFTER_ATTEMPTS
from roundtable.temporal import data_converter

HERE = Path(__file__).parent
STALLED = HERE / "histories_nondeterministic" / "chaos-client-4.json"
# Sealed with the chaos harness's throwaway secret, as the stall was.
FAILED = EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
DONE = EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
TIMED_OUT = EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT
NONDET = NONDETERMINISTIC
CHAOS_KEYS = data_converter(EncryptionCodec([(DEFAULT_KEY_ID, derive_payload_key(SECRET))]))


def stalled() -> WorkflowHistory:
    return WorkflowHistory.from_json("chaos-client-4", STALLED.read_text())


async def test_the_stall_is_found_at_the_takeover_task() -> None:
    # The worker that took the run over completed the task at event 49 with
    # its webhook numbered 13 (event 51); this code numbers it 12. Every task
    # before it replays; the run failed its tasks at events 129 and 133.
    assert await first_divergent_task(stalled(), CHAOS_KEYS) == 49


async def test_a_history_cut_before_the_takeover_has_nothing_to_recover() -> None:
    events = list(stalled().events)
    cut = next(i for i, e in enumerate(events) if e.event_id == 49)
    # Up to the takeover task's start: the task runs live and checks nothing.
    assert await first_divergent_task(WorkflowHistory("c4", events[:cut]), CHAOS_KEYS) is None


async def test_a_divergence_in_the_last_task_is_found() -> None:
    """The bisection's upper end: the last completion is the divergent one."""
    events = list(stalled().events)
    first_bad_check = next(
        i
        for i, e in enumerate(events)
        if e.event_id > 49 and e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED
    )
    history = WorkflowHistory("c4", events[: first_bad_check + 1])
    assert await first_divergent_task(history, CHAOS_KEYS) == 49


APPROVED_ONCE = {
    path.parent.name: path.read_text()
    for path in sorted(HERE.glob("histories/**/test_approved_write_executes_once.json"))
}


@pytest.mark.parametrize("recorded", APPROVED_ONCE)
async def test_a_history_that_replays_has_nothing_to_recover(recorded: str) -> None:
    history = WorkflowHistory.from_json(recorded, APPROVED_ONCE[recorded])
    assert await first_divergent_task(history, data_converter()) is None


async def test_a_history_no_key_opens_is_not_recoverable() -> None:
    """A reset does not mend a payload this worker cannot open: say so, reset nothing."""
    with pytest.raises(NotRecoverableError, match="does not replay"):
        await first_divergent_task(stalled(), data_converter())


def _event(event_id: int, kind: int, message: str = "", cause: int = 0) -> HistoryEvent:
    event = HistoryEvent(event_id=event_id, event_type=kind)  # type: ignore[arg-type]
    if kind == FAILED:
        event.workflow_task_failed_event_attributes.failure.message = message
        event.workflow_task_failed_event_attributes.cause = cause  # type: ignore[assignment]
    return event


def test_the_stall_is_evidence_and_a_task_not_yet_failing_thrice_is_not() -> None:
    assert not_stalled_by_divergence(STALLED_AFTER_ATTEMPTS, stalled()) is None
    # A signal makes Temporal start the failing task afresh: say to try again.
    assert "try again shortly" in (not_stalled_by_divergence(1, stalled()) or "")


@pytest.mark.parametrize(
    ("events", "why"),
    [
        # Found in review: an old nondeterminism a later task got past, and a
        # current task that only times out (a frozen worker), is no evidence.
        (
            [_event(5, FAILED, "[TMPRL1100] x", NONDET), _event(9, DONE), _event(12, TIMED_OUT)],
            TIMING_OUT,
        ),
        ([_event(5, FAILED, "[TMPRL1100] x", NONDET), _event(9, DONE)], NOT_RECORDED),
        ([_event(9, DONE), _event(12, FAILED, "KeyError: 'x'")], "another reason"),
    ],
)
def test_only_the_current_task_failing_by_a_divergence_is_evidence(events, why) -> None:  # type: ignore[no-untyped-def]
    history = WorkflowHistory("synthetic", events)
    assert why in (not_stalled_by_divergence(STALLED_AFTER_ATTEMPTS + 2, history) or "")


def test_core_refusing_an_event_is_evidence_too() -> None:
    events = [_event(9, DONE), _event(12, FAILED, f"{MACHINES_REFUSED}: TimerMachine …")]
    assert not_stalled_by_divergence(STALLED_AFTER_ATTEMPTS, WorkflowHistory("s", events)) is None
