"""Where a stalled run is reset: the first workflow task whose commands this
code does not make again (roundtable/recovery.py), found on real histories."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHistory

from chaos.stack import SECRET
from roundtable.codec import DEFAULT_KEY_ID, EncryptionCodec, derive_payload_key
from roundtable.recovery import NotRecoverableError, first_divergent_task
from roundtable.temporal import data_converter

HERE = Path(__file__).parent
STALLED = HERE / "histories_nondeterministic" / "chaos-client-4.json"
# Sealed with the chaos harness's throwaway secret, as the stall was.
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
