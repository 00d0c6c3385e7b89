"""A write's intercept and its decision carry the run's status in their own
transactions (workflows/status.py): the store, the search attributes and the
run's history must still tell the same story as when every change was
published on its own, and publish nothing twice."""

from __future__ import annotations

import asyncio
from datetime import timedelta

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
        # Only the run's end publishes on its own: opening the run carried
        # "running" in the transaction that pinned its snapshot.
        assert await _local_activities(h.client, history) == [
            "open run",
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


# Found by an adversarial review of the first version, which held the board's
# lock across a carried write and trusted whatever the last write said.

TWO_SEATS = script(
    ("seat-1", 1, [ticket_call("ticket_update", "T-1")]),
    ("seat-2", 1, [ticket_call("ticket_update", "T-2")]),
)


async def _by_seat(h, handle) -> dict[str, str]:
    state = await h.wait_for(handle, lambda s: len(s.pending_approvals) == 2)
    return {w.seat: a for a, w in state.pending_approvals.items()}


async def _writing(h, count: int) -> None:
    for _ in range(400):
        if len(await h.tickets.write_log()) >= count:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("no write began")


async def test_a_decision_that_keeps_failing_stalls_no_other_decision(tmp_path) -> None:
    """An attestation stamped without a time zone once made the decision
    retry for ever, holding the board: no other decision got through."""
    from datetime import datetime

    from roundtable.models import Attestation

    async with harness(tmp_path) as h:
        handle = await h.start(
            task_text="t", seats=["seat-1", "seat-2"], mode="parallel", script=TWO_SEATS
        )
        by_seat = await _by_seat(h, handle)
        naive = Attestation(role="operator", at=datetime(2026, 1, 1), mac="x")
        odd = Decision(
            approval_id=by_seat["seat-1"],
            decision="approved",
            decided_by="someone",
            attested_by=naive,
        )
        # No zone, no attestation: decided as nobody in particular (R2 needs no operator).
        assert await handle.execute_update(RoundtableWorkflow.decide_approval, odd) == "approved"
        good = Decision(approval_id=by_seat["seat-2"], decision="approved", decided_by="op-1")
        assert (
            await asyncio.wait_for(
                handle.execute_update(RoundtableWorkflow.decide_approval, good), 40
            )
            == "approved"
        )
        assert (await handle.result()).status == "completed"


async def test_a_decision_never_shows_the_run_running_while_a_write_is_unknown(tmp_path) -> None:
    from tests.test_closed_runs import acts_then_raises
    from tests.test_workflow_execution import wrap_tool

    async with harness(
        tmp_path,
        restartable=True,
        write_delay=1.0,
        customize=lambda registry, _: wrap_tool(registry, "ticket_update", acts_then_raises),
    ) as h:
        handle = await h.start(
            task_text="t", seats=["seat-1", "seat-2"], mode="parallel", script=TWO_SEATS
        )
        by_seat = await _by_seat(h, handle)
        assert await _decide(handle, by_seat["seat-2"]) == "approved"
        await _writing(h, 1)
        await h.stop_worker()  # seat-2's write ends unknown while no worker polls
        last = asyncio.create_task(_decide(handle, by_seat["seat-1"]))
        await asyncio.sleep(0.5)
        await h.start_worker()
        assert await last == "approved"
        await h.wait_for(handle, lambda s: not s.pending_approvals and bool(s.unknown_actions))
        changes = await _status_changes(h.store, handle.id)
        await handle.terminate(reason="test done")
        assert changes == [("pending", "running"), ("running", "waiting_input")], changes


async def test_a_decision_retrying_in_its_activity_holds_up_nobody_else(tmp_path) -> None:
    """A tenant-limited operator's decision needs the write's arguments; when
    they cannot be opened the decision's activity fails and is retried. The
    other seat's decision goes through meanwhile."""
    from datetime import UTC, datetime

    from roundtable.permissions import Decider, attest
    from roundtable.security import encrypt_arguments
    from roundtable.store.schema import ActionSecretRow
    from tests.helpers import set_column

    async with harness(tmp_path) as h:
        # While the stuck decision retries, the other's update reaches the
        # run at its workflow task's heartbeat (80% of the task's timeout):
        # 4 s tasks rather than 10 s, so the test waits less for it.
        handle = await h.start(
            task_text="t",
            seats=["seat-1", "seat-2"],
            mode="parallel",
            script=TWO_SEATS,
            task_timeout=timedelta(seconds=4),
        )
        by_seat = await _by_seat(h, handle)
        approval = await h.store.get_approval(by_seat["seat-1"])
        foreign = encrypt_arguments({"x": 1}, associated_data=b"another-action")
        await set_column(
            h.store,
            ActionSecretRow,
            ActionSecretRow.action_id == approval["action_id"],
            arguments_encrypted=foreign,
        )
        limited = Decider(user_id="op-2", role="operator", tenants=("acme",))
        stuck_decision = attest(
            Decision(approval_id=by_seat["seat-1"], decision="approved", decided_by="op-2"),
            limited,
            datetime.now(UTC),
        )
        stuck = asyncio.create_task(
            handle.execute_update(RoundtableWorkflow.decide_approval, stuck_decision)
        )
        await asyncio.sleep(1.0)
        try:
            decided = await asyncio.wait_for(_decide(handle, by_seat["seat-2"]), 40)
            assert decided == "approved"
            assert (await h.store.get_approval(by_seat["seat-2"]))["status"] == "approved"
        finally:
            stuck.cancel()
            await handle.terminate(reason="test done")


async def test_the_last_decision_landing_with_a_settled_write_does_not_flap(tmp_path) -> None:
    async with harness(tmp_path, restartable=True, write_delay=1.0) as h:
        handle = await h.start(
            task_text="t", seats=["seat-1", "seat-2"], mode="parallel", script=TWO_SEATS
        )
        by_seat = await _by_seat(h, handle)
        assert await _decide(handle, by_seat["seat-1"]) == "approved"
        await _writing(h, 1)
        await h.stop_worker()
        last = asyncio.create_task(_decide(handle, by_seat["seat-2"]))
        await asyncio.sleep(0.5)
        await h.start_worker()
        assert await last == "approved"
        assert (await handle.result()).status == "completed"
        changes = await _status_changes(h.store, handle.id)
        assert changes.count(("running", "waiting_input")) == 1, changes


async def test_a_stalled_run_moves_on_when_its_workflow_does(tmp_path) -> None:
    """The sweep marks a run stalled behind the board's back; the next change
    the run makes on its own (here an edited approval, which carries nothing)
    writes its status again, as before."""
    async with harness(tmp_path) as h:
        handle = await h.start(
            task_text="t", seats=["seat-1", "seat-2"], mode="parallel", script=TWO_SEATS
        )
        by_seat = await _by_seat(h, handle)
        await h.store.set_run_status(
            handle.id, "stalled", {"code": "workflow_task_failing", "message": "boom"}
        )
        edited = {"tenant_id": "acme", "ticket_id": "T-1", "fields": {"priority": "low"}}
        edit = Decision(
            approval_id=by_seat["seat-1"],
            decision="approved",
            decided_by="op-1",
            arguments=edited,
        )
        assert await handle.execute_update(RoundtableWorkflow.decide_approval, edit) == "approved"
        await h.wait_for(handle, lambda s: len(s.pending_approvals) == 1)
        for _ in range(100):
            if (await h.store.get_run(handle.id))["status"] != "stalled":
                break
            await asyncio.sleep(0.05)
        run = await h.store.get_run(handle.id)
        await handle.terminate(reason="test done")
        assert run["status"] == "waiting_input", run
