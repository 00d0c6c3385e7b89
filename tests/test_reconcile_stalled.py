"""An unknown action of a stalled run is reconciled (review of 2026-12-07).

A run whose workflow tasks keep failing (a deploy it cannot replay on, a
payload no worker can read) is open, and Temporal refuses it every update at
once (FAILED_PRECONDITION, "Workflow Task in failed state"). Reconciling
tried the run's workflow first and let that refusal out untyped: the API
answered 500, and the store path, which needs nothing of the run's
workflow, was never tried, so the target stayed blocked for every other run
until the run was recovered or terminated. "Every unknown is reconcilable,
open workflow or not" (docs/architecture.md).
"""

from __future__ import annotations

import pytest

from tests.api_server import serve_api
from tests.test_closed_runs import answer_lost, unknown_update
from tests.test_recovery import stall
from tests.test_workflow_approvals import one_write
from tests.workflow_harness import harness


@pytest.mark.timeout(240)
async def test_an_unknown_of_a_stalled_run_is_reconciled_through_the_store(tmp_path) -> None:
    async with (
        harness(
            tmp_path,
            customize=answer_lost,
            dev_server=True,
        ) as h,
        serve_api(h) as api,
    ):
        handle, action_id = await unknown_update(h)
        await stall(h, handle)  # its workflow task now fails on every attempt

        answer = await api.http.post(
            f"/v1/actions/{action_id}/reconcile",
            headers=api.auth("ops"),
            json={"outcome": "succeeded", "note": "the ticket shows the write"},
        )
        action = await h.store.get_action(action_id)
        events = await h.store.list_events(handle.id)
        await handle.terminate(reason="test done")
    assert answer.status_code == 200, answer.text
    assert (answer.json()["status"], answer.json()["via"]) == ("succeeded", "store")
    assert action["status"] == "succeeded"
    assert action["result"]["reconciled_by"] == "ops"
    reconciled = [e["payload"] for e in events if e["event_type"] == "action.reconciled"]
    assert [(e["decided_by"], e["outcome"]) for e in reconciled] == [("ops", "succeeded")]


@pytest.mark.timeout(240)
async def test_a_decision_on_a_stalled_run_is_a_503_of_its_own_not_a_decided_conflict(
    tmp_path,
) -> None:
    """A client reads 409 "conflict" as "someone decided first" and gives
    up (chaos/operator_bot.py does); a stalled run decided nothing, and the
    same decision may stand once the run is recovered."""
    async with harness(tmp_path, dev_server=True) as h, serve_api(h) as api:
        handle = await h.start(task_text="t", script=one_write(), user_id="alice")
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        await stall(h, handle)
        _, action = await h.store.approval_and_action(approval_id)
        answer = await api.http.post(
            f"/v1/approvals/{approval_id}/decision",
            headers=api.auth("ops"),
            json={
                "decision": "approved",
                "reason": "fine",
                "arguments_digest": action["arguments_digest"],
            },
        )
        approval = await h.store.get_approval(approval_id)
        await handle.terminate(reason="test done")
    assert approval["status"] == "pending"
    assert (answer.status_code, answer.json()["code"]) == (503, "workflow_stalled"), answer.text
    assert "recover" in answer.json()["detail"]
