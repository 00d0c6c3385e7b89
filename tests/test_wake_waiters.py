"""A write waiting for its target tries again as soon as the target frees,
not when its backoff timer (grown to half a minute and more) fires: the write
or the reconciliation that frees the target wakes the runs waiting on it."""

from __future__ import annotations

from temporalio.api.enums.v1 import EventType

from tests.test_closed_runs import AUTO, acts_then_raises, update
from tests.test_workflow_execution import reconcile, wrap_tool
from tests.workflow_harness import harness


async def timers(handle, kind: int) -> int:  # type: ignore[no-untyped-def]
    return len([e async for e in handle.fetch_history_events() if e.event_type == kind])


async def backoff_timers(handle) -> int:  # type: ignore[no-untyped-def]
    return await timers(handle, EventType.EVENT_TYPE_TIMER_STARTED)


async def cancelled_timers(handle) -> int:  # type: ignore[no-untyped-def]
    """A backoff timer cancelled: the write was woken before it fired."""
    return await timers(handle, EventType.EVENT_TYPE_TIMER_CANCELED)


async def test_a_blocked_write_runs_as_soon_as_its_target_is_reconciled(tmp_path) -> None:
    customize = lambda reg, _t: wrap_tool(reg, "ticket_update", acts_then_raises)  # noqa: E731
    async with harness(tmp_path, customize=customize) as h:
        lost = await h.start(task_text="t", script=update("T-1", "a"), write_policy=AUTO)
        state = await h.wait_for(lost, lambda s: bool(s.unknown_actions))
        (unknown_id,) = state.unknown_actions
        waiting = await h.start(task_text="t", script=update("T-1", "b"), write_policy=AUTO)
        await h.wait_for(waiting, lambda s: s.blocked_reason is not None)
        # Let its backoff grow: 1 + 2 + 4 + 8 + 16 s skipped, the next timer
        # is 32 s away, and time no longer skips (the test polls queries).
        await h.env.sleep(31)
        assert await backoff_timers(waiting) >= 5
        await reconcile(lost, unknown_id, "succeeded")
        # Within a few seconds of real time, far less than the timer's 32 s.
        done = await h.wait_for(waiting, lambda s: s.status == "completed", within=8)
        assert done.blocked_reason is None
        assert await cancelled_timers(waiting) == 1
    log = await h.tickets.write_log()
    assert [(w["ticket_id"], w["fencing_token"]) for w in log] == [("T-1", 1), ("T-1", 2)]


async def test_a_busy_write_runs_as_soon_as_the_holder_finishes(tmp_path) -> None:
    """Real time: the holder's write takes 5 s; the waiter's timers fire at
    about 1, 3 and 7 s. Woken when the holder's write ends, it cancels the
    timer it was waiting on (a history fact, not a timing)."""
    async with harness(tmp_path, write_delay=5.0) as h:
        holder = await h.start(task_text="t", script=update("T-1", "a"), write_policy=AUTO)
        await h.wait_for(holder, lambda s: s.status in ("running", "waiting_input"))
        waiting = await h.start(task_text="t", script=update("T-1", "b"), write_policy=AUTO)
        with h.env.auto_time_skipping_disabled():
            await holder.result()
            await waiting.result()
        assert await cancelled_timers(waiting) == 1
    log = await h.tickets.write_log()
    first, second = sorted(log, key=lambda w: w["fencing_token"])
    assert first["finished_at"] <= second["started_at"]  # never overlapped
