"""A write whose lease is lost stops writing.

Once seen on main: renewal failing, the tool went on; the action became
unknown, an operator reconciled it, the next writer claimed the ticket, and
then the old call finished its write. Now the moment the lease cannot be
renewed the call is cancelled, and reconciliation waits until the attempt is
over. The demo ticket system's log is the ground truth throughout.
"""

from __future__ import annotations

import asyncio
import itertools
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.exc import OperationalError
from temporalio import activity
from temporalio.client import WorkflowUpdateFailedError

from roundtable.store.schema import ActionLeaseRow
from roundtable.tools.registry import ToolDefinition
from roundtable.tools.tickets import TicketRef
from tests.helpers import set_column
from tests.test_workflow_execution import attempt_ended, reconcile, wrap_tool
from tests.workflow_harness import Harness, harness, script, ticket_call

AUTO = "auto_approve_up_to:R3"
ONE_UPDATE = script(("seat-1", 1, [ticket_call("ticket_update", fields={"owner": "first"})]))
SECOND_UPDATE = script(("seat-1", 1, [ticket_call("ticket_update", fields={"owner": "second"})]))


async def started_write(h: Harness, within: float = 20) -> dict:
    for _ in range(int(within / 0.05)):
        log = await h.tickets.write_log()
        if log:
            return log[0]
        await asyncio.sleep(0.05)
    raise AssertionError("the write never reached the ticket system")


async def executing_action(h: Harness, run_id: str) -> dict:
    (action,) = await h.store.list_actions(run_id)
    assert action["status"] == "executing"
    return action


def assert_no_overlap(log: list[dict]) -> None:
    spans = sorted(
        (datetime.fromisoformat(w["started_at"]), datetime.fromisoformat(w["finished_at"]))
        for w in log
    )
    for (_, first_end), (second_start, _) in itertools.pairwise(spans):
        assert first_end <= second_start, f"two writes to one ticket overlapped: {log}"


async def test_a_refused_renewal_cancels_the_tool_before_it_writes(tmp_path) -> None:
    async with harness(tmp_path, write_delay=3.0) as h:
        first = await h.start(
            task_text="t", script=ONE_UPDATE, write_policy=AUTO, heartbeat_timeout_seconds=3
        )
        await started_write(h)
        action = await executing_action(h, first.id)
        # The lease lapses under the call (a clock jump, a stalled renewal):
        # the next renewal is refused.
        await set_column(
            h.store,
            ActionLeaseRow,
            ActionLeaseRow.action_id == action["id"],
            lease_expires_at=datetime.now(UTC) - timedelta(seconds=1),
        )
        state = await h.wait_for(first, lambda s: bool(s.unknown_actions))
        lost = await h.store.get_action(action["id"])
        assert lost["status"] == "unknown"
        assert lost["result"] == {"error_code": "lease_lost", "reason": "lease_renewal_refused"}
        (written,) = await h.tickets.write_log()
        assert written["outcome"] == "abandoned"  # cancelled before it applied
        ticket = await h.tickets.read("acme", "T-1")
        assert ticket is None or "owner" not in ticket["fields"]

        # Nobody else writes the ticket until the unknown is settled.
        second = await h.start(
            task_text="t", script=SECOND_UPDATE, write_policy=AUTO, heartbeat_timeout_seconds=3
        )
        await h.wait_for(second, lambda s: bool(s.blocked_writes))
        assert [a["status"] for a in await h.store.list_actions(second.id)] == ["approved"]

        assert list(state.unknown_actions) == [action["id"]]
        await reconcile(first, action["id"], "failed")  # the attempt is over: allowed at once
        assert (await second.result()).status == "completed"
        log = await h.tickets.write_log()
        assert [w["outcome"] for w in log] == ["abandoned", "applied"]
        assert log[1]["fencing_token"] > log[0]["fencing_token"]
        assert_no_overlap(log)
        assert (await h.tickets.read("acme", "T-1"))["fields"]["owner"] == "second"
        assert (await first.result()).status == "completed"


async def update_until_unknown(h: Harness, heartbeat: int, lease: int):  # type: ignore[no-untyped-def]
    """Start a run whose one auto-approved update ends unknown; (handle, state)."""
    handle = await h.start(
        task_text="t",
        script=ONE_UPDATE,
        write_policy=AUTO,
        heartbeat_timeout_seconds=heartbeat,
        lease_seconds=lease,
    )
    return handle, await h.wait_for(handle, lambda s: bool(s.unknown_actions), within=30)


async def _raises() -> str | None:
    raise OperationalError("UPDATE action_leases", {}, Exception("database is gone"))


async def _hangs() -> str | None:
    await asyncio.Event().wait()
    return None


def after_the_call_started(real, failure):  # type: ignore[no-untyped-def]
    """The store's hold, failing from the keeper's first renewal on (the hold
    made just before the call started still succeeds)."""
    holds = 0

    async def hold(*args, **kwargs) -> str | None:  # type: ignore[no-untyped-def]
        nonlocal holds
        holds += 1
        return await (real(*args, **kwargs) if holds == 1 else failure())

    return hold


@pytest.mark.parametrize(
    ("renewal", "reason"),
    [(_raises, "lease_renewal_failed"), (_hangs, "lease_renewal_timed_out")],
    ids=["renewal_errors", "renewal_hangs_past_the_lease"],
)
async def test_a_renewal_that_fails_mid_call_cancels_the_tool(
    tmp_path, monkeypatch, renewal, reason: str
) -> None:
    async with harness(tmp_path, write_delay=8.0) as h:
        monkeypatch.setattr(
            h.store, "hold_action_lease", after_the_call_started(h.store.hold_action_lease, renewal)
        )
        handle, _ = await update_until_unknown(h, heartbeat=3, lease=6)
        (action,) = await h.store.list_actions(handle.id)
        assert action["result"] == {"error_code": "lease_lost", "reason": reason}
        (written,) = await h.tickets.write_log()
        assert written["outcome"] == "abandoned"
        # The call ended before the lease could lapse in the database.
        lease_end = await lease_expiry(h, action["id"])
        assert datetime.fromisoformat(written["finished_at"]) <= lease_end


async def lease_expiry(h: Harness, action_id: str) -> datetime:
    from sqlalchemy import select

    async with h.store.session_factory() as session:
        return (
            await session.execute(
                select(ActionLeaseRow.lease_expires_at).where(ActionLeaseRow.action_id == action_id)
            )
        ).scalar_one()


def slow_to_stop(handler):  # type: ignore[no-untyped-def]
    """Honours cancellation only once its request is done, like a client
    waiting for a remote call to come back before it can give up."""

    async def handle(args, ctx):  # type: ignore[no-untyped-def]
        work = asyncio.ensure_future(handler(args, ctx))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            await work
            raise

    return handle


async def test_a_call_slow_to_stop_keeps_its_lease_until_it_has_ended(
    tmp_path, monkeypatch
) -> None:
    """Found in review: the call was cancelled one renewal before the lease
    could lapse, then given 30 s to wind down, unrenewed. The lease lapsed,
    an operator reconciled, a successor claimed, and the old call was still
    running. Now its lease is held for as long as the call runs."""
    monkeypatch.setattr(activity, "heartbeat", lambda *details: None)  # Temporal gives up
    async with harness(
        tmp_path,
        write_delay=14.0,  # the call ends ~14 s in: far past its 6 s lease
        customize=lambda reg, _t: wrap_tool(reg, "ticket_update", slow_to_stop),
    ) as h:
        first, state = await update_until_unknown(h, heartbeat=2, lease=6)
        (action_id,) = state.unknown_actions
        second = await h.start(task_text="t", script=SECOND_UPDATE, write_policy=AUTO)
        for _ in range(8):  # well past the lease's first expiry, the call still runs
            assert (
                await h.tickets.write_log() and not (await h.tickets.write_log())[0]["finished_at"]
            )
            with pytest.raises(WorkflowUpdateFailedError):
                await reconcile(first, action_id, "failed")
            await asyncio.sleep(1)
        await attempt_ended(h, first.id, action_id, within=30)
        assert await reconcile(first, action_id, "succeeded") == "succeeded"
        assert (await second.result()).status == "completed"
        log = await h.tickets.write_log()
        assert [w["outcome"] for w in log] == ["applied", "applied"]
        assert_no_overlap(log)


def remote_write(registry, _tickets) -> None:  # type: ignore[no-untyped-def]
    """A write whose effects may outlive its call (a remote API)."""

    async def post(args, ctx) -> dict:  # type: ignore[no-untyped-def]
        raise TimeoutError("no answer from the remote system")

    registry.register(
        ToolDefinition(
            name="remote_post",
            description="Post to a remote system.",
            side_effect="write",
            risk_level="R2",
            handler=post,
            args_model=TicketRef,
            target_key_fields=("tenant_id", "ticket_id"),
        )
    )


async def test_a_remote_call_that_gave_up_is_not_over_until_its_lease_runs_out(
    tmp_path,
) -> None:
    call = {"name": "remote_post", "args": {"tenant_id": "acme", "ticket_id": "T-9"}}
    async with harness(tmp_path, customize=remote_write) as h:
        handle = await h.start(
            task_text="t",
            script=script(("seat-1", 1, [call])),
            write_policy=AUTO,
            heartbeat_timeout_seconds=2,
            lease_seconds=4,
        )
        state = await h.wait_for(handle, lambda s: bool(s.unknown_actions))
        (action_id,) = state.unknown_actions
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await reconcile(handle, action_id, "failed")  # the request may still land
        assert "may still be executing" in str(refused.value.cause)
        await asyncio.sleep(4.5)
        assert await reconcile(handle, action_id, "failed") == "failed"
        assert (await handle.result()).status == "completed"
