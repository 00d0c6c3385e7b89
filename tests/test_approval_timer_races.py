"""An approval's timer firing in the same workflow task as a message about it.

While no worker polls, skipped time fires the approval's timer and a message
(a decision, a refresh, a cancellation) waits beside it in the history: the
next worker gets both in one task. Whatever it makes of them, the store and
the run must agree (expired or decided, never both; at most one write, one
warning), and the history must replay whatever clock its tasks read
(tests/test_replay_clock.py).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError, WorkflowHandle

from roundtable.models import Decision
from tests.test_replay_clock import SHIFTS, _replay_failure, with_clocks
from tests.test_webhooks import receiver, with_webhooks
from tests.workflow_harness import Harness, harness, script, ticket_call
from workflows.roundtable import RoundtableWorkflow

ONE_WRITE = script(("seat-1", 1, [ticket_call("ticket_update")]))


async def _pending(h: Harness, handle: WorkflowHandle) -> str:
    state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
    (approval_id,) = state.pending_approvals
    return approval_id


async def _fire_while_no_worker(h: Harness, handle: WorkflowHandle, seconds: int) -> None:
    """Stop the worker, skip ``seconds`` (up to the timer: once it fires the
    test server skips no further while its task waits for a worker): the
    timer fires into a history no worker reads yet (checked, not assumed).
    A delivery still under way would hold skipped time back: it ends first."""
    await _until_activities_closed(handle)
    await h.stop_worker()
    await h.env.sleep(seconds)
    kinds = [e.event_type async for e in handle.fetch_history_events()]
    fired = len(kinds) - 1 - kinds[::-1].index(EventType.EVENT_TYPE_TIMER_FIRED)
    assert EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED not in kinds[fired:]


async def _until_activities_closed(handle: WorkflowHandle, within: float = 20) -> None:
    """Poll the history until every activity scheduled has closed."""
    opened = EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    closed = {
        EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
        EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED,
        EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT,
        EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED,
    }
    deadline = asyncio.get_running_loop().time() + within
    while True:
        kinds = [e.event_type async for e in handle.fetch_history_events()]
        if kinds.count(opened) == sum(kinds.count(k) for k in closed):
            return
        assert asyncio.get_running_loop().time() < deadline, "activities still open"
        await asyncio.sleep(0.05)


async def _replays_whatever_clock(handle: WorkflowHandle) -> None:
    text = (await handle.fetch_history()).to_json()
    for shift in SHIFTS.values():
        assert await _replay_failure(handle.id, with_clocks(text, shift)) is None


async def _told(h: Harness, handle: WorkflowHandle) -> str:
    (told,) = [m for m in (await h.state(handle)).threads["seat-1"] if m.role == "tool"]
    return json.loads(told.content)["outcome"]


async def test_a_decision_in_the_task_where_the_deadline_fires_agrees_with_the_store(
    tmp_path,
) -> None:
    async with harness(tmp_path, restartable=True) as h:
        handle = await h.start(task_text="t", script=ONE_WRITE, approval_timeout_seconds=600)
        approval_id = await _pending(h, handle)
        await _fire_while_no_worker(h, handle, 600)
        await handle.signal(
            RoundtableWorkflow.approval_decision,
            Decision(approval_id=approval_id, decision="approved", decided_by="op-1"),
        )
        await h.start_worker()
        assert (await h.result(handle)).status == "completed"

        approval = await h.store.get_approval(approval_id)
        (action,) = await h.store.list_actions(handle.id)
        writes = await h.tickets.write_log()
        if approval["status"] == "expired":
            assert (action["status"], len(writes), await _told(h, handle)) == (
                "rejected",
                0,
                "rejected",
            )
        else:
            assert approval["status"] == "approved"
            assert (action["status"], len(writes), await _told(h, handle)) == (
                "succeeded",
                1,
                "succeeded",
            )
        events = [e["event_type"] for e in await h.store.list_events(handle.id)]
        assert events.count("approval.expired") + events.count("approval.approved") == 1
        await _replays_whatever_clock(handle)


async def test_a_refresh_in_the_task_where_the_warning_fires_warns_once(tmp_path) -> None:
    async with (
        receiver() as hook,
        harness(tmp_path, restartable=True, worker_factory=with_webhooks(hook.url, lead=300)) as h,
    ):
        handle = await h.start(task_text="t", script=ONE_WRITE, approval_timeout_seconds=3600)
        approval_id = await _pending(h, handle)
        await _fire_while_no_worker(h, handle, 3300)  # the warning's time, not the deadline's
        await handle.signal(RoundtableWorkflow.refresh)
        await h.start_worker()
        assert (await h.result(handle)).status == "completed"  # skips on to the deadline

        assert hook.events().count("approval.expiring") == 1
        assert (await h.store.get_approval(approval_id))["status"] == "expired"
        events = [e["event_type"] for e in await h.store.list_events(handle.id)]
        assert events.count("approval.expired") == 1
        await _replays_whatever_clock(handle)


async def test_an_extension_heard_in_the_task_where_the_old_deadline_fires(tmp_path) -> None:
    """The database extended the approval (the workflow is told by a refresh
    that waits beside the old deadline's timer): no expiry, and the approval
    is still decidable."""
    async with harness(tmp_path, restartable=True) as h:
        handle = await h.start(task_text="t", script=ONE_WRITE, approval_timeout_seconds=600)
        approval_id = await _pending(h, handle)
        first = (await h.state(handle)).pending_approvals[approval_id].approval_deadline
        await h.store.extend_approval(approval_id, 3600, "op-1", 7200)
        await _fire_while_no_worker(h, handle, 600)
        await handle.signal(RoundtableWorkflow.refresh)
        await h.start_worker()
        await h.wait_for(  # the run follows the database's new deadline
            handle,
            lambda s: (
                approval_id in s.pending_approvals
                and s.pending_approvals[approval_id].approval_deadline > first
            ),
        )
        assert (await h.store.get_approval(approval_id))["status"] == "pending"
        assert (
            await handle.execute_update(
                RoundtableWorkflow.decide_approval,
                Decision(approval_id=approval_id, decision="approved", decided_by="op-1"),
            )
            == "approved"
        )
        assert (await h.result(handle)).status == "completed"
        assert len(await h.tickets.write_log()) == 1
        events = [e["event_type"] for e in await h.store.list_events(handle.id)]
        assert "approval.expired" not in events
        await _replays_whatever_clock(handle)


async def test_a_cancellation_in_the_task_where_the_deadline_fires_writes_nothing(
    tmp_path,
) -> None:
    async with harness(tmp_path, restartable=True) as h:
        handle = await h.start(task_text="t", script=ONE_WRITE, approval_timeout_seconds=600)
        approval_id = await _pending(h, handle)
        await _fire_while_no_worker(h, handle, 600)
        await handle.cancel()
        await h.start_worker()
        with pytest.raises(WorkflowFailureError):
            await h.result(handle)

        assert (await h.store.get_approval(approval_id))["status"] in ("expired", "withdrawn")
        (action,) = await h.store.list_actions(handle.id)
        assert action["status"] == "rejected"
        assert await h.tickets.write_log() == []
        assert (await h.store.get_run(handle.id))["status"] == "cancelled"
        await _replays_whatever_clock(handle)
