"""The typed client a backend service uses."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from roundtable.client import (
    ConflictError,
    NotFoundError,
    RoundtableClient,
    RunInput,
    ScriptDocument,
)
from tests.workflow_harness import harness, script, ticket_call


async def _waiting_for(client: RoundtableClient, calls: list) -> tuple[Any, list[str]]:
    """svc-42's one-seat run of ``calls``, once every write waits for its
    approval: its handle and the approvals, sorted."""
    handle = await client.start_run(
        RunInput(
            task_text="t",
            user_id="svc-42",
            script=ScriptDocument.model_validate(script(("seat-1", 1, calls), final="ok")),
        )
    )
    for _ in range(200):
        state = await handle.state()
        if len(state.pending_approvals) == len(calls):
            break
        await asyncio.sleep(0.05)
    return handle, sorted(state.pending_approvals)


async def test_start_decide_and_result(tmp_path) -> None:
    async with harness(tmp_path) as h:
        client = RoundtableClient(h.client, h.task_queue)
        handle, (approval_id,) = await _waiting_for(client, [ticket_call("ticket_update")])
        with pytest.raises(ConflictError):
            await handle.decide("not-pending", "approved", decided_by="svc-42")
        assert await handle.decide(approval_id, "approved", decided_by="svc-42") == "approved"
        with pytest.raises(ConflictError):
            await handle.decide(approval_id, "approved", decided_by="svc-42")
        result = await handle.result()
        assert (result.status, result.final_answer) == ("completed", "ok")
        assert (await h.store.get_run(handle.run_id))["user_id"] == "svc-42"
        with pytest.raises(NotFoundError):  # the run is over: asked of the store, not there
            await client.reconcile(handle.run_id, "nothing", "failed", decided_by="svc-42")


async def test_a_service_decision_sent_again_under_its_key_is_answered_once(tmp_path) -> None:
    """A service whose answer was lost sends the decision again under its
    key: answered as the first, decided once. Two writes keep the run open
    while the first approval is decided twice."""
    calls = [ticket_call("ticket_update", "T-1"), ticket_call("ticket_update", "T-2")]
    async with harness(tmp_path) as h:
        client = RoundtableClient(h.client, h.task_queue)
        handle, (first, second) = await _waiting_for(client, calls)
        for _ in range(2):
            decided = await handle.decide(
                first, "approved", decided_by="svc-42", idempotency_key="approve-first"
            )
            assert decided == "approved"
        with pytest.raises(ConflictError):  # another key: another request
            await handle.decide(first, "approved", decided_by="svc-42", idempotency_key="other")
        with pytest.raises(ConflictError):  # the same key, another decision
            await handle.decide(
                first, "rejected", decided_by="svc-42", idempotency_key="approve-first"
            )
        await handle.decide(second, "approved", decided_by="svc-42")
        assert (await handle.result()).status == "completed"
        events = await h.store.list_events(handle.run_id)
        approved = [e for e in events if e["event_type"] == "approval.approved"]
        assert [e["payload"]["approval_id"] for e in approved].count(first) == 1


async def test_starting_the_same_run_twice_starts_it_once(tmp_path) -> None:
    async with harness(tmp_path) as h:
        client = RoundtableClient(h.client, h.task_queue)
        request = RunInput(task_text="t", run_id="run-order-7")
        first = await client.start_run(request)
        assert (await first.result()).status == "completed"
        execution = (await h.client.get_workflow_handle(first.run_id).describe()).run_id
        again = await client.start_run(request)  # after it finished: nothing new
        assert again.run_id == first.run_id
        assert (await h.client.get_workflow_handle(first.run_id).describe()).run_id == execution
        with pytest.raises(ConflictError):
            await client.start_run(RunInput(task_text="other", run_id="run-order-7"))
