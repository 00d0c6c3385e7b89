"""A write's intercept and its decision carry the run's status in their own
transactions (workflows/status.py): the store, the search attributes and the
run's history must still tell the same story as when every change was
published on its own, and publish nothing twice."""

from __future__ import annotations

import asyncio

from temporalio.api.enums.v1 import EventType

from roundtable.models import Decision
from tests.workflow_harness import harness, script, ticket_call
from workflows import search_attributes as sa
from workflows.roundtable import RoundtableWorkflow


async def _decide(handle, approval_id: str) -> str:
    return await handle.execute_update(
        RoundtableWorkflow.decide_approval,
        Decision(approval_id=approval_id, decision="approved", decided_by="op-1"),
    )


async def _status_changes(store, run_id: str) -> list[tuple[str, str]]:
    events = await store.list_events(run_id)
    return [
        (e["payload"]["from"], e["payload"]["to"])
        for e in events
        if e["event_type"] == "run.status_changed"
    ]


async def _local_activities(client, history) -> list[str]:
    """The summaries of the run's local activities (decoded: summaries are
    encrypted like every payload)."""
    converter = client.data_converter
    markers = [
        e.user_metadata.summary
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED and e.HasField("user_metadata")
    ]
    return list(await converter.decode(markers)) if markers else []


async def test_an_approved_write_moves_the_run_in_its_own_transactions(tmp_path) -> None:
    async with harness(tmp_path) as h:
        handle = await h.start(
            task_text="raise priority", script=script(("seat-1", 1, [ticket_call("ticket_update")]))
        )
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        # The transaction that opened the approval moved the run.
        assert (await h.store.get_run(handle.id))["status"] == "waiting_input"
        (approval_id,) = state.pending_approvals
        assert await _decide(handle, approval_id) == "approved"
        # The decision's transaction moved it back, before the write ran.
        assert (await h.store.get_run(handle.id))["status"] in ("running", "completed")
        assert (await handle.result()).status == "completed"

        assert await _status_changes(h.store, handle.id) == [
            ("pending", "running"),
            ("running", "waiting_input"),
            ("waiting_input", "running"),
            ("running", "completed"),
        ]
        history = await handle.fetch_history()
        # Only the run's start and end publish on their own.
        assert await _local_activities(h.client, history) == [
            "run is running",
            "intercept ticket_update from seat-1",
            "record approved",
            "run is completed",
        ]
        upserts = [
            e
            for e in history.events
            if e.event_type == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES
        ]
        assert len(upserts) >= 4  # running, waiting_input, running, completed (+ patches)
        shown = (await handle.describe()).typed_search_attributes
        assert shown.get(sa.STATUS) == "completed" and shown.get(sa.PENDING_APPROVALS) == 0
        assert await h.store.verify_audit_chain(handle.id)


async def test_the_run_waits_until_its_last_approval_is_decided(tmp_path) -> None:
    two_seats = script(
        ("seat-1", 1, [ticket_call("ticket_update", "T-1")]),
        ("seat-2", 1, [ticket_call("ticket_update", "T-2")]),
    )
    async with harness(tmp_path) as h:
        handle = await h.start(
            task_text="t", seats=["seat-1", "seat-2"], mode="parallel", script=two_seats
        )
        state = await h.wait_for(handle, lambda s: len(s.pending_approvals) == 2)
        first, second = state.pending_approvals
        assert await _decide(handle, first) == "approved"
        # One approval still open: the decision's transaction leaves the run waiting.
        assert (await h.store.get_run(handle.id))["status"] == "waiting_input"
        await h.wait_for(handle, lambda s: first not in s.pending_approvals)
        shown = (await handle.describe()).typed_search_attributes
        assert shown.get(sa.STATUS) == "waiting_input" and shown.get(sa.PENDING_APPROVALS) == 1
        assert await _decide(handle, second) == "approved"
        assert (await handle.result()).status == "completed"
        changes = await _status_changes(h.store, handle.id)
        assert changes[-2:] == [("waiting_input", "running"), ("running", "completed")]
        assert changes.count(("running", "waiting_input")) == 1


async def test_decisions_landing_together_leave_the_store_as_the_run_shows(tmp_path) -> None:
    """Two decisions in one workflow task, while the seats' writes run: each
    decision's transaction carries a status, and the last word in the store
    must be the run's own."""
    two_seats = script(
        ("seat-1", 1, [ticket_call("ticket_update", "T-1")]),
        ("seat-2", 1, [ticket_call("ticket_update", "T-2")]),
    )
    async with harness(tmp_path, restartable=True) as h:
        handle = await h.start(
            task_text="t", seats=["seat-1", "seat-2"], mode="parallel", script=two_seats
        )
        state = await h.wait_for(handle, lambda s: len(s.pending_approvals) == 2)
        await h.stop_worker()
        decided = [
            asyncio.create_task(_decide(handle, approval_id))
            for approval_id in state.pending_approvals
        ]
        await asyncio.sleep(0.5)  # both updates wait in the history for the worker
        await h.start_worker()
        assert await asyncio.gather(*decided) == ["approved", "approved"]
        assert (await handle.result()).status == "completed"
        assert (await h.store.get_run(handle.id))["status"] == "completed"
        changes = await _status_changes(h.store, handle.id)
        assert changes[-1] == ("running", "completed")
