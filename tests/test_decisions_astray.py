"""Decisions that once went astray: refused decisions that gave an approval up,
signals attributed to the wrong sender, an expiry that beat an extension, two
tool calls sharing one id."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

import pytest
from temporalio.client import Client, WorkflowUpdateFailedError

from roundtable.client import ConflictError, RoundtableClient
from roundtable.models import Decision
from roundtable.store.schema import ApprovalRow
from roundtable.temporal import data_converter
from tests.helpers import set_column
from tests.workflow_harness import Harness, harness, script, ticket_call
from workflows.roundtable import RoundtableWorkflow

ONE_WRITE = script(("seat-1", 1, [ticket_call("ticket_update")]))
WRONG_DIGEST = "sha256:" + "0" * 64


async def pending(h: Harness, handle) -> str:  # type: ignore[no-untyped-def]
    state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
    (approval_id,) = state.pending_approvals
    return approval_id


async def still_pending(h: Harness, handle, approval_id: str) -> None:  # type: ignore[no-untyped-def]
    """The workflow and the database agree: nobody has decided yet."""
    await asyncio.sleep(0.3)  # give a wrongly-handled refusal time to show
    assert approval_id in (await h.state(handle)).pending_approvals
    assert (await h.store.get_approval(approval_id))["status"] == "pending"


async def approve(handle, approval_id: str, digest: str | None = None) -> str:  # type: ignore[no-untyped-def]
    return await handle.execute_update(
        RoundtableWorkflow.decide_approval,
        Decision(
            approval_id=approval_id,
            decision="approved",
            decided_by="op-1",
            arguments_digest=digest,
        ),
    )


async def finishes_with_one_write(h: Harness, handle) -> None:  # type: ignore[no-untyped-def]
    assert (await handle.result()).status == "completed"
    assert [w["outcome"] for w in await h.tickets.write_log()] == ["applied"]


async def test_a_raw_update_with_a_wrong_digest_leaves_the_approval_pending(tmp_path) -> None:
    async with harness(tmp_path) as h:
        handle = await h.start(task_text="t", script=ONE_WRITE)
        approval_id = await pending(h, handle)
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await approve(handle, approval_id, WRONG_DIGEST)
        assert "arguments_digest does not match" in str(refused.value.cause)
        await still_pending(h, handle, approval_id)
        assert await approve(handle, approval_id) == "approved"
        await finishes_with_one_write(h, handle)


async def test_a_signal_with_a_wrong_digest_leaves_the_approval_pending(tmp_path) -> None:
    async with harness(tmp_path) as h:
        handle = await h.start(task_text="t", script=ONE_WRITE)
        approval_id = await pending(h, handle)
        await handle.signal(
            RoundtableWorkflow.approval_decision,
            Decision(
                approval_id=approval_id,
                decision="approved",
                decided_by="op-1",
                arguments_digest=WRONG_DIGEST,
            ),
        )
        await still_pending(h, handle, approval_id)
        assert await approve(handle, approval_id) == "approved"
        await finishes_with_one_write(h, handle)


async def test_the_typed_client_with_a_wrong_digest_leaves_the_approval_pending(
    tmp_path,
) -> None:
    async with harness(tmp_path) as h:
        handle = await h.start(task_text="t", script=ONE_WRITE)
        approval_id = await pending(h, handle)
        run = RoundtableClient(h.client, h.task_queue).handle(handle.id)
        with pytest.raises(ConflictError):
            await run.decide(
                approval_id, "approved", decided_by="svc", arguments_digest=WRONG_DIGEST
            )
        await still_pending(h, handle, approval_id)
        digest = (await h.store.get_action((await h.store.get_approval(approval_id))["action_id"]))[
            "arguments_digest"
        ]
        assert await run.decide(approval_id, "approved", decided_by="svc", arguments_digest=digest)
        await finishes_with_one_write(h, handle)


async def test_edits_refused_after_the_deadline_leave_the_database_in_charge(tmp_path) -> None:
    """The deadline passed by the database's clock before the workflow's timer
    fired: edits are refused and the approval is still pending, so the run
    must not tell the seat anything yet; the database's expiry then decides."""
    async with harness(tmp_path) as h:
        handle = await h.start(task_text="t", script=ONE_WRITE)
        approval_id = await pending(h, handle)
        await set_column(
            h.store,
            ApprovalRow,
            ApprovalRow.id == approval_id,
            expires_at=datetime.now(UTC) - timedelta(seconds=1),
        )
        edits = Decision(
            approval_id=approval_id,
            decision="approved",
            decided_by="op-1",
            arguments={"tenant_id": "acme", "ticket_id": "T-1", "fields": {"priority": "low"}},
        )
        with pytest.raises(WorkflowUpdateFailedError):
            await handle.execute_update(RoundtableWorkflow.decide_approval, edits)
        await still_pending(h, handle, approval_id)
        with pytest.raises(WorkflowUpdateFailedError):  # the database expires it on the spot
            await approve(handle, approval_id)
        assert (await handle.result()).status == "completed"
        assert (await h.store.get_approval(approval_id))["status"] == "expired"
        told = [m for m in (await h.state(handle)).threads["seat-1"] if m.role == "tool"]
        assert json.loads(told[0].content)["outcome"] == "rejected"
        assert await h.tickets.write_log() == []


async def test_two_signals_in_one_workflow_task_keep_their_own_senders(tmp_path) -> None:
    """Alice approves and Bob rejects while no worker runs, so both signals
    reach the workflow in one task. Whichever decision the database took, its
    decided_by and reason must be that sender's, never a mix."""
    async with harness(tmp_path, restartable=True) as h:
        handle = await h.start(task_text="t", script=ONE_WRITE)
        approval_id = await pending(h, handle)
        await h.stop_worker()
        target = h.client.service_client.config.target_host
        for who, decision in (("alice", "approved"), ("bob", "rejected")):
            sender = await Client.connect(
                target, namespace=h.client.namespace, identity=who, data_converter=data_converter()
            )
            await sender.get_workflow_handle(handle.id).signal(
                RoundtableWorkflow.approval_decision,
                Decision(
                    approval_id=approval_id,
                    decision=decision,
                    decided_by="mallory",  # the body's claim is never believed
                    reason=f"{who}'s reason",
                    request_id=f"req-{who}",
                ),
            )
        await h.start_worker()
        assert (await handle.result()).status == "completed"
        decided = await h.store.get_approval(approval_id)
        winner = "alice" if decided["status"] == "approved" else "bob"
        assert decided["decided_by"] == f"temporal:{winner}"
        assert decided["decision_reason"] == f"{winner}'s reason"


async def test_identical_signals_from_two_senders_are_attributed_to_nobody(tmp_path) -> None:
    async with harness(tmp_path, restartable=True) as h:
        handle = await h.start(task_text="t", script=ONE_WRITE)
        approval_id = await pending(h, handle)
        await h.stop_worker()
        target = h.client.service_client.config.target_host
        same = Decision(approval_id=approval_id, decision="approved", decided_by="x", reason="same")
        for who in ("alice", "bob"):
            sender = await Client.connect(
                target, namespace=h.client.namespace, identity=who, data_converter=data_converter()
            )
            await sender.get_workflow_handle(handle.id).signal(
                RoundtableWorkflow.approval_decision, same
            )
        await h.start_worker()
        assert (await handle.result()).status == "completed"
        assert (await h.store.get_approval(approval_id))["decided_by"] == "temporal:unknown"


async def test_an_extension_that_committed_first_is_never_followed_by_an_expiry(
    tmp_path,
) -> None:
    """The extension reached the database, but the workflow's timer for the
    old deadline fired before it heard: the expiry must compare against the
    deadline as it now stands, and the workflow wait for the new one."""
    async with harness(tmp_path) as h:
        handle = await h.start(task_text="t", script=ONE_WRITE, approval_timeout_seconds=600)
        approval_id = await pending(h, handle)
        await h.store.extend_approval(approval_id, 3600, "op-1", 7200)  # the workflow is not told
        await h.env.sleep(700)  # past the old deadline, in skipped time
        await still_pending(h, handle, approval_id)
        assert await approve(handle, approval_id) == "approved"
        await finishes_with_one_write(h, handle)


async def test_two_tool_calls_sharing_an_id_are_two_writes(tmp_path) -> None:
    """Models repeat call ids within a turn. Two different writes must never
    be merged into one, nor leave an action approved for ever."""
    first = ticket_call("ticket_update", "T-1", fields={"owner": "a"})
    second = ticket_call("ticket_update", "T-2", fields={"owner": "b"})
    both = script(("seat-1", 1, [{**first, "id": "dup"}, {**second, "id": "dup"}]))
    async with harness(tmp_path) as h:
        handle = await h.start(task_text="t", script=both, write_policy="auto_approve_up_to:R3")
        assert (await handle.result()).status == "completed"
        actions = await h.store.list_actions(handle.id)
        assert sorted(a["status"] for a in actions) == ["succeeded", "succeeded"]
        assert len({a["idempotency_key"] for a in actions}) == 2
        assert sorted(w["ticket_id"] for w in await h.tickets.write_log()) == ["T-1", "T-2"]
        told = [m for m in (await h.state(handle)).threads["seat-1"] if m.role == "tool"]
        assert sorted(m.tool_call_id for m in told) == ["dup", "dup#2"]
        assert all(json.loads(m.content)["outcome"] == "succeeded" for m in told)


async def test_a_stale_decision_through_an_interface_never_reaches_the_workflow(tmp_path) -> None:
    """Found in review: a run started before safety-rules-v1 takes any decision
    its workflow hears as final, even one the store refused, and would drop the
    write. The API, the CLI and the client stop a stale digest before Temporal."""
    from roundtable import operations
    from roundtable.store import ConflictError as StoreConflict

    async with harness(tmp_path) as h:
        handle = await h.start(task_text="t", script=ONE_WRITE)
        approval_id = await pending(h, handle)
        with pytest.raises(StoreConflict, match="arguments_digest"):
            await operations.decide(
                h.client, h.store, approval_id, "approved", "op-1", arguments_digest=WRONG_DIGEST
            )
        history = await handle.fetch_history()
        assert not [
            e
            for e in history.events
            if e.HasField("workflow_execution_update_accepted_event_attributes")
        ]
        await still_pending(h, handle, approval_id)
