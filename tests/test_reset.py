"""A reset run meets its own writes again, in whatever state the store holds
them, and steers them on: never an orphan nobody can settle.

Once seen on main: after a reset, intercept handed back an action already
``unknown`` (or ``executing``); the workflow told the seat ``not_approved`` and
went on, leaving the action blocking its ticket with no run waiting on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest
from temporalio.client import WorkflowHandle, WorkflowUpdateFailedError

from roundtable.models import RunResult
from tests.test_closed_runs import acts_then_raises
from tests.test_workflow_execution import reconcile, wrap_tool
from tests.workflow_harness import Harness, harness, script, ticket_call
from workflows.roundtable import RoundtableWorkflow

AUTO = "auto_approve_up_to:R3"
ONE_UPDATE = script(("seat-1", 1, [ticket_call("ticket_update")]))


async def reset_to_start(h: Harness, handle: WorkflowHandle) -> WorkflowHandle:
    """Reset to the end of the first workflow task: everything after it runs again."""
    history = await handle.fetch_history()
    first_task = next(
        e.event_id
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
    )
    described = await handle.describe()
    response = await h.client.workflow_service.reset_workflow_execution(
        ResetWorkflowExecutionRequest(
            namespace=h.client.namespace,
            workflow_execution=WorkflowExecution(workflow_id=handle.id, run_id=described.run_id),
            reason="test: reset",
            workflow_task_finish_event_id=first_task,
            request_id=str(uuid.uuid4()),
        )
    )
    return h.client.get_workflow_handle(handle.id, run_id=response.run_id, result_type=RunResult)


async def writing(h) -> None:  # type: ignore[no-untyped-def]
    """Until the ticket system has seen a write begin."""
    for _ in range(200):
        if await h.tickets.write_log():
            return
        await asyncio.sleep(0.05)


async def test_a_reset_run_tracks_an_action_already_unknown(tmp_path) -> None:
    async with harness(
        tmp_path,
        dev_server=True,
        customize=lambda reg, _t: wrap_tool(reg, "ticket_update", acts_then_raises),
    ) as h:
        handle = await h.start(task_text="t", script=ONE_UPDATE, write_policy=AUTO)
        state = await h.wait_for(handle, lambda s: bool(s.unknown_actions))
        (action_id,) = state.unknown_actions

        again = await reset_to_start(h, handle)
        state = await h.wait_for(again, lambda s: bool(s.unknown_actions), within=30)
        assert list(state.unknown_actions) == [action_id]  # the same action, tracked
        assert state.status == "waiting_input"
        assert await reconcile(again, action_id, "succeeded") == "succeeded"
        assert (await again.result()).status == "completed"
        assert [w["outcome"] for w in await h.tickets.write_log()] == ["applied"]  # once


async def test_a_reset_run_follows_an_action_still_executing(tmp_path) -> None:
    async with harness(tmp_path, dev_server=True, write_delay=3.0) as h:
        handle = await h.start(
            task_text="t", script=ONE_UPDATE, write_policy=AUTO, heartbeat_timeout_seconds=2
        )
        await writing(h)
        (action,) = await h.store.list_actions(handle.id)
        assert action["status"] == "executing"

        again = await reset_to_start(h, handle)
        # The old attempt still holds the lease: the new run waits for it to
        # come to an end, then takes what the store says.
        for _ in range(600):
            state = await again.query(RoundtableWorkflow.state)
            stored = await h.store.get_action(action["id"])
            if stored["status"] == "unknown" and state.unknown_actions:
                with contextlib.suppress(WorkflowUpdateFailedError):  # lease not yet run out
                    await reconcile(again, action["id"], "failed")
            if stored["status"] in ("succeeded", "failed"):
                break
            await asyncio.sleep(0.05)
        assert (await again.result()).status == "completed"
        assert len(await h.store.list_actions(handle.id)) == 1  # never a second action
        assert len(await h.tickets.write_log()) == 1  # never a second write


async def test_a_reset_run_cancelled_while_the_old_attempt_runs_waits_quietly(tmp_path) -> None:
    """Found in review: the ending run saw the action still executing under
    the old attempt and looped with no timer, thousands of events a second."""
    async with harness(tmp_path, dev_server=True, write_delay=6.0) as h:
        handle = await h.start(
            task_text="t", script=ONE_UPDATE, write_policy=AUTO, heartbeat_timeout_seconds=2
        )
        await writing(h)
        again = await reset_to_start(h, handle)
        await asyncio.sleep(1)
        await again.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(again.result(), 60)
        history = await again.fetch_history()
        assert len(history.events) < 300, len(history.events)
        (action,) = await h.store.list_actions(handle.id)
        assert action["status"] in ("succeeded", "unknown")  # the old attempt's own end
        assert (await h.store.get_run(handle.id))["status"] == "cancelled"
        assert len(await h.tickets.write_log()) == 1
