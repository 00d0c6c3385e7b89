"""An operator's extension or edited approval is answered from its own
transaction, never read back after the commit (review of the pool sizing,
2026-12-06).

The local activity that records either is retried when it fails. When it
read the approval back after its transaction had committed, a failure of
that read (a starved pool's checkout timing out, a connection lost) failed
the activity with the change already recorded, and the retry applied it as
new: an extension extended twice (the deadline moved twice, two audit
events by the operator, two of the bounded extensions spent); an edited
approval, found no longer pending, was answered as a conflict, and the seat
was never told of the operator's edits.

Here, on PostgreSQL, the first pooled checkout after the commit that
records the change fails, as a lost connection's would."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.exc import TimeoutError as PoolTimeout

from roundtable.models import Decision, ExtendInput, ExtendOutput
from tests.workflow_harness import harness, script, ticket_call
from workflows.roundtable import RoundtableWorkflow

# The edited arguments the operator approves: another ticket, another priority.
EDITED = {"tenant_id": "acme", "ticket_id": "T-2", "fields": {"priority": "high"}}


async def approve_edited(handle: Any, approval_id: str) -> str:
    """op-1 approves ``approval_id`` with EDITED, through the run's update."""
    return await handle.execute_update(
        RoundtableWorkflow.decide_approval,
        Decision(approval_id=approval_id, decision="approved", decided_by="op-1", arguments=EDITED),
    )


async def seat_was_told_of_edits(h: Any, handle: Any) -> None:
    """The seat's tool result for its one write carries the operator's edits."""
    told = [
        json.loads(m.content) for m in (await h.state(handle)).threads["seat-1"] if m.role == "tool"
    ]
    assert "operator_edits" in told[0]["result"], told[0]["result"]


@contextmanager
def checkout_fails_after_commit_of(engine: Any, event_type: str) -> Iterator[list[str]]:
    """The first checkout from ``engine``'s pool after a transaction that
    wrote an audit event of ``event_type`` commits raises, once. Yields what
    happened, in order."""
    seen: list[str] = []
    sync = engine.sync_engine

    def noted(conn, _cursor, _statement, parameters, _context, _many) -> None:  # type: ignore[no-untyped-def]
        if event_type in repr(parameters):
            conn.info["wrote_the_change"] = True

    def committed(conn) -> None:  # type: ignore[no-untyped-def]
        if conn.info.pop("wrote_the_change", False):
            seen.append("committed")

    def checkout(_dbapi, _record, _proxy) -> None:  # type: ignore[no-untyped-def]
        if seen == ["committed"]:
            seen.append("checkout failed")
            raise PoolTimeout("QueuePool limit of size 1 overflow 0 reached (injected)")

    event.listen(sync, "before_cursor_execute", noted)
    event.listen(sync, "commit", committed)
    event.listen(sync.pool, "checkout", checkout)
    try:
        yield seen
    finally:
        event.remove(sync.pool, "checkout", checkout)
        event.remove(sync, "commit", committed)
        event.remove(sync, "before_cursor_execute", noted)


@pytest.mark.timeout(300)
async def test_an_extension_whose_next_checkout_fails_is_applied_once(
    tmp_path, postgres_url
) -> None:
    calls = script(("seat-1", 1, [ticket_call("ticket_update", "T-1")]))
    async with harness(tmp_path, database_url=postgres_url) as h:
        handle = await h.start(task_text="t", script=calls, approval_timeout_seconds=60)
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        first = (await h.store.get_approval(approval_id))["expires_at"]
        with checkout_fails_after_commit_of(h.store.engine, "approval.extended") as seen:
            answered = await handle.execute_update(
                RoundtableWorkflow.extend_approval,
                ExtendInput(approval_id=approval_id, seconds=3600, extended_by="op-1"),
                result_type=ExtendOutput,
            )
        assert seen[0] == "committed"
        now = (await h.store.get_approval(approval_id))["expires_at"]
        events = await h.store.list_events(handle.id)
        extensions = [e for e in events if e["event_type"] == "approval.extended"]
        await handle.terminate()
        # One request: one extension of 3600 s, one audit event, and the
        # answer is the deadline that stands.
        assert len(extensions) == 1, [e["payload"] for e in extensions]
        assert now == first + timedelta(seconds=3600)
        assert answered.expires_at == now


@pytest.mark.timeout(300)
async def test_an_edited_approval_whose_next_checkout_fails_is_answered_and_told(
    tmp_path, postgres_url
) -> None:
    calls = [ticket_call("ticket_update", "T-1", fields={"priority": "low"})]
    async with harness(tmp_path, database_url=postgres_url) as h:
        handle = await h.start(task_text="t", script=script(("seat-1", 1, calls)))
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        with checkout_fails_after_commit_of(h.store.engine, "action.arguments_edited") as seen:
            answer = await approve_edited(handle, approval_id)
        assert seen[0] == "committed"
        assert answer == "approved"  # what the operator asked is what stands
        assert (await h.result(handle)).status == "completed"
        (write,) = await h.tickets.write_log()
        assert write["ticket_id"] == "T-2"
        await seat_was_told_of_edits(h, handle)
        events = await h.store.list_events(handle.id)
        edits = [e for e in events if e["event_type"] == "action.arguments_edited"]
        assert len(edits) == 1 and edits[0]["payload"]["edited_by"] == "op-1"
