"""The workflow's approval path on a real (time-skipping) Temporal server."""

from __future__ import annotations

import json

import pytest
from temporalio.client import WorkflowUpdateFailedError
from temporalio.service import RPCError

from roundtable.models import Decision
from roundtable.store import ConflictError
from tests.workflow_harness import harness, script, ticket_call
from workflows.roundtable import RoundtableWorkflow


def one_write(name: str = "ticket_update") -> dict:
    return script(("seat-1", 1, [ticket_call(name)]))


async def test_approved_write_executes_once(tmp_path) -> None:
    async with harness(tmp_path) as h:
        handle = await h.start(task_text="raise priority", script=one_write())
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        assert state.status == "waiting_input"
        (approval_id,) = state.pending_approvals

        outcome = await handle.execute_update(
            RoundtableWorkflow.decide_approval,
            Decision(approval_id=approval_id, decision="approved", decided_by="op-1"),
        )
        assert outcome == "approved"
        result = await handle.result()
        assert result.status == "completed" and result.final_answer == "done"

        writes = await h.tickets.write_log()
        assert [(w["operation"], w["outcome"]) for w in writes] == [("update", "applied")]
        (action,) = await h.store.list_actions(handle.id)
        assert action["status"] == "succeeded" and action["attempt_count"] == 1
        assert writes[0]["idempotency_key"] == action["idempotency_key"]
        assert writes[0]["fencing_token"] == action["fencing_token"]
        assert (await h.store.get_run(handle.id))["status"] == "completed"
        # The seat is told how its write went.
        final = await h.state(handle)
        tool_messages = [m for m in final.threads["seat-1"] if m.role == "tool"]
        told = json.loads(tool_messages[0].content)
        assert told["outcome"] == "succeeded" and told["result"]["ticket_id"] == "T-1"


async def decide(handle, approval_id: str, decision: str, who: str = "op-1") -> str:
    return await handle.execute_update(
        RoundtableWorkflow.decide_approval,
        Decision(approval_id=approval_id, decision=decision, decided_by=who),
    )


async def test_rejected_write_never_runs_and_the_seat_is_told(tmp_path) -> None:
    async with harness(tmp_path) as h:
        handle = await h.start(task_text="close it", script=one_write("ticket_close"))
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        assert await decide(handle, approval_id, "rejected") == "rejected"
        assert (await handle.result()).status == "completed"
        assert await h.tickets.write_log() == []
        (action,) = await h.store.list_actions(handle.id)
        assert action["status"] == "rejected"
        told = [m for m in (await h.state(handle)).threads["seat-1"] if m.role == "tool"]
        assert json.loads(told[0].content)["outcome"] == "rejected"


async def test_approval_expires_on_the_workflow_timer(tmp_path) -> None:
    async with harness(tmp_path) as h:
        handle = await h.start(
            task_text="t", script=one_write(), approval_timeout_seconds=7 * 24 * 3600
        )
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        # Awaiting the result lets the test server skip the seven days.
        assert (await handle.result()).status == "completed"

        approval = await h.store.get_approval(approval_id)
        assert approval["status"] == "expired"
        (action,) = await h.store.list_actions(handle.id)
        assert action["status"] == "rejected"
        events = await h.store.list_events(handle.id)
        assert any(
            e["event_type"] == "action.rejected"
            and e["payload"].get("reason") == "approval_expired"
            for e in events
        )
        # The run has finished: the server refuses updates to a closed workflow.
        with pytest.raises(RPCError):
            await decide(handle, approval_id, "approved")

        with pytest.raises(ConflictError):
            await h.store.decide_approval(approval_id, "approved", "late-op")
        assert await h.tickets.write_log() == []


async def test_update_validator_refuses_unknown_and_decided_approvals(tmp_path) -> None:
    async with harness(tmp_path) as h:
        handle = await h.start(task_text="t", script=one_write())
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await decide(handle, "no-such-approval", "approved")
        assert "not pending" in str(refused.value.cause)
        await decide(handle, approval_id, "approved")
        with pytest.raises(WorkflowUpdateFailedError):
            await decide(handle, approval_id, "rejected")
        await handle.result()
        assert len(await h.tickets.write_log()) == 1


async def test_signal_decision_for_fire_and_forget_operators(tmp_path) -> None:
    async with harness(tmp_path) as h:
        handle = await h.start(task_text="t", script=one_write())
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        await handle.signal(
            RoundtableWorkflow.approval_decision,
            Decision(approval_id=approval_id, decision="approved", decided_by="chatops"),
        )
        assert (await handle.result()).status == "completed"
        # A raw signal is attributed to its sender's Temporal identity (read
        # from the history), never to the name written in its body.
        decided_by = (await h.store.get_approval(approval_id))["decided_by"]
        assert decided_by == f"temporal:{h.client.identity}"
        assert "chatops" not in decided_by
        assert len(await h.tickets.write_log()) == 1


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("auto_approve_up_to:R2", "succeeded"),
        ("auto_approve_up_to:R1", "waiting"),
        ("deny_writes", "rejected"),
    ],
)
async def test_write_policies(tmp_path, policy: str, expected: str) -> None:
    async with harness(tmp_path) as h:
        handle = await h.start(
            task_text="t", script=one_write("ticket_update"), write_policy=policy
        )
        if expected == "waiting":  # R2 is above the R1 ceiling: a person decides
            state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
            await decide(handle, next(iter(state.pending_approvals)), "approved")
            expected = "succeeded"
        await handle.result()
        (action,) = await h.store.list_actions(handle.id)
        assert action["status"] == expected
        assert len(await h.tickets.write_log()) == (1 if expected == "succeeded" else 0)


async def test_malformed_calls_become_errors_for_the_seat_not_actions(tmp_path) -> None:
    calls = [
        {"name": "ticket_delete_everything", "args": {}},
        {"name": "ticket_update", "args": {"tenant_id": "acme"}},
        ticket_call("ticket_get"),
    ]
    async with harness(tmp_path) as h:
        handle = await h.start(
            task_text="t",
            script=script(("seat-1", 1, calls)),
            tools=["ticket_get", "ticket_update"],
        )
        assert (await handle.result()).status == "completed"
        assert await h.store.list_actions(handle.id) == []
        told = [
            json.loads(m.content)
            for m in (await h.state(handle)).threads["seat-1"]
            if m.role == "tool"
        ]
        assert [t["outcome"] for t in told] == ["error", "error", "succeeded"]
        assert told[0]["result"]["error_code"] == "unknown_tool"
        assert told[1]["result"]["error_code"] == "invalid_arguments"
        assert "fields" in told[1]["result"]["message"]
        assert told[2]["result"] == {"found": False, "tenant_id": "acme", "ticket_id": "T-1"}


async def test_an_extended_approval_outlives_its_first_deadline(tmp_path) -> None:
    from datetime import timedelta

    from roundtable.models import ExtendInput, ExtendOutput

    async with harness(tmp_path) as h:
        handle = await h.start(task_text="t", script=one_write(), approval_timeout_seconds=60)
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        first = state.pending_approvals[approval_id].approval_deadline
        extended = await handle.execute_update(
            RoundtableWorkflow.extend_approval,
            ExtendInput(approval_id=approval_id, seconds=3600, extended_by="op-1"),
            result_type=ExtendOutput,
        )
        assert extended.expires_at == first + timedelta(seconds=3600)
        # Skip past the first deadline but not the new one: still pending.
        await h.env.sleep(120)
        state = await h.state(handle)
        assert approval_id in state.pending_approvals
        assert (await h.store.get_approval(approval_id))["status"] == "pending"
        await decide(handle, approval_id, "approved")
        assert (await handle.result()).status == "completed"
        assert len(await h.tickets.write_log()) == 1
