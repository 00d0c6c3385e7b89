"""Approve with edits: corrected arguments meet every check the originals did,
the change is audited without secrets, and the seat is told."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

import pytest
from temporalio.client import WorkflowUpdateFailedError

from roundtable.models import Decision
from roundtable.security import REDACTED, derive_target
from roundtable.store import ConflictError
from roundtable.tools.tickets import TicketRef
from tests.api_server import serve_api
from tests.helpers import WRITE_TOOL, new_action, new_run, snapshot, target_for
from tests.workflow_harness import harness, script, ticket_call
from workflows.roundtable import RoundtableWorkflow


async def test_store_swaps_arguments_digest_and_target_in_one_step(store) -> None:
    run = await new_run(store)
    action = await new_action(
        store,
        run,
        key="e",
        target_key=target_for("task-1"),
        status="waiting_approval",
        arguments={"tenant_id": "tenant-a", "object_id": "task-1", "token": "s3cret"},
        safe_argument_fields=["tenant_id", "object_id"],
        approval_expires_at=datetime.now(UTC) + timedelta(minutes=5),
    )
    edited = {"tenant_id": "tenant-a", "object_id": "task-2", "token": "n3w-s3cret"}
    target = derive_target(WRITE_TOOL, edited, snapshot(), "seat-1")
    approval, changes = await store.approve_with_edits(
        action["approval_id"], "op-1", "wrong task", action["arguments_digest"], edited, target
    )
    assert approval["status"] == "approved"
    assert changes == [
        {"field": "object_id", "before": "task-1", "after": "task-2"},
        {"field": "token", "before": REDACTED, "after": REDACTED},
    ]
    stored = await store.get_action(action["id"])
    assert stored["status"] == "approved" and stored["target_key"] == target.key
    assert stored["arguments"] == {
        "tenant_id": "tenant-a",
        "object_id": "task-2",
        "token": REDACTED,
    }
    assert stored["arguments_digest"] != action["arguments_digest"]
    assert await store.get_action_arguments(action["id"]) == edited
    events = await store.list_events(run["id"])
    assert "s3cret" not in repr(events)
    assert [e["event_type"] for e in events][-3:] == [
        "action.arguments_edited",
        "approval.approved",
        "action.approved",
    ]
    with pytest.raises(ConflictError):  # decided once
        await store.approve_with_edits(action["approval_id"], "op-1", None, None, edited, target)


async def decide(handle, approval_id: str, **fields) -> str:  # type: ignore[no-untyped-def]
    return await handle.execute_update(
        RoundtableWorkflow.decide_approval,
        Decision(approval_id=approval_id, decision="approved", decided_by="op-1", **fields),
    )


async def test_an_edited_write_runs_with_the_edits_and_the_seat_is_told(tmp_path) -> None:
    calls = [ticket_call("ticket_update", "T-1", fields={"priority": "low"})]
    async with harness(tmp_path) as h:
        handle = await h.start(task_text="t", script=script(("seat-1", 1, calls)))
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals

        bad = {"tenant_id": "acme", "ticket_id": "T-2"}  # no fields: the schema says no
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await decide(handle, approval_id, arguments=bad)
        assert "edited arguments refused" in str(refused.value.cause)
        assert (await h.store.get_approval(approval_id))["status"] == "pending"

        edited = {"tenant_id": "acme", "ticket_id": "T-2", "fields": {"priority": "high"}}
        assert await decide(handle, approval_id, arguments=edited) == "approved"
        assert (await handle.result()).status == "completed"

        (write,) = await h.tickets.write_log()
        assert (write["ticket_id"], write["outcome"]) == ("T-2", "applied")
        ticket = await h.tickets.get(TicketRef(tenant_id="acme", ticket_id="T-2"), None)
        assert ticket["fields"] == {"priority": "high"}
        told = [
            json.loads(m.content)
            for m in (await h.state(handle)).threads["seat-1"]
            if m.role == "tool"
        ]
        assert {"field": "ticket_id", "before": "T-1", "after": "T-2"} in (
            told[0]["result"]["operator_edits"]
        )


async def test_api_approves_with_edits_and_refuses_bad_ones(tmp_path) -> None:
    calls = [ticket_call("ticket_update", "T-1")]
    async with harness(tmp_path) as h, serve_api(h) as api:
        response = await api.http.post(
            "/v1/runs",
            json={"task_text": "t", "script": script(("seat-1", 1, calls))},
            headers=api.auth("alice"),
        )
        run_id = response.json()["run_id"]
        state = await h.wait_for(
            h.client.get_workflow_handle(run_id), lambda s: bool(s.pending_approvals)
        )
        (approval_id,) = state.pending_approvals
        approval = (
            await api.http.get(f"/v1/approvals/{approval_id}", headers=api.auth("alice"))
        ).json()
        path = f"/v1/approvals/{approval_id}/decision"
        base = {"decision": "approved", "arguments_digest": approval["arguments_digest"]}

        rejected_edit = await api.http.post(
            path,
            headers=api.auth("alice"),
            json={**base, "decision": "rejected", "arguments": {"x": 1}},
        )
        assert rejected_edit.status_code == 422
        invalid = await api.http.post(
            path, headers=api.auth("alice"), json={**base, "arguments": {"tenant_id": "acme"}}
        )
        assert invalid.status_code == 422, invalid.text
        assert "fields" in invalid.json()["detail"]

        good = await api.http.post(
            path,
            headers=api.auth("alice"),
            json={
                **base,
                "arguments": {
                    "tenant_id": "acme",
                    "ticket_id": "T-1",
                    "fields": {"status": "escalated"},
                },
            },
        )
        assert good.status_code == 200, good.text
        await h.client.get_workflow_handle(run_id).result()
        after = (
            await api.http.get(f"/v1/approvals/{approval_id}", headers=api.auth("alice"))
        ).json()
        assert after["arguments"]["fields"] == {"status": "escalated"}
        assert after["arguments_digest"] != approval["arguments_digest"]


async def test_a_bad_signal_never_fails_the_run(tmp_path) -> None:
    """Signals are fire-and-forget: a refused one is logged, the run goes on."""
    async with harness(tmp_path) as h:
        handle = await h.start(
            task_text="t", script=script(("seat-1", 1, [ticket_call("ticket_update")]))
        )
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        for bad in (
            Decision(
                approval_id=approval_id,
                decision="approved",
                decided_by="x",
                arguments={"tenant_id": "acme"},
            ),
            Decision(approval_id="nope", decision="approved", decided_by="x"),
        ):
            await handle.signal(RoundtableWorkflow.approval_decision, bad)
        await asyncio.sleep(1)
        description = await handle.describe()
        assert description.status.name == "RUNNING"
        assert (await h.store.get_approval(approval_id))["status"] == "pending"
        await decide(handle, approval_id)
        assert (await handle.result()).status == "completed"
