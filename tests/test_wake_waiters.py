"""A write waiting for its target tries again as soon as the target frees,
not when its backoff timer (grown to half a minute and more) fires: the write
or the reconciliation that frees the target wakes the runs waiting on it."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime

from temporalio.api.enums.v1 import EventType

from roundtable.store import NotFoundError
from tests.test_closed_runs import AUTO, acts_then_raises, update
from tests.test_workflow_execution import reconcile, wrap_tool
from tests.workflow_harness import harness


async def timers(handle, kind: int) -> int:  # type: ignore[no-untyped-def]
    return len([e async for e in handle.fetch_history_events() if e.event_type == kind])


async def backoff_timers(handle) -> int:  # type: ignore[no-untyped-def]
    return await timers(handle, EventType.EVENT_TYPE_TIMER_STARTED)


async def until_executing(h, handle) -> None:  # type: ignore[no-untyped-def]
    for _ in range(400):
        with contextlib.suppress(NotFoundError):  # the run is not recorded yet
            actions = await h.store.list_actions(handle.id)
            if actions and actions[0]["status"] == "executing":
                return
        await asyncio.sleep(0.025)
    raise AssertionError("the holder's write never started")


async def test_a_blocked_write_runs_as_soon_as_its_target_is_reconciled(tmp_path) -> None:
    customize = lambda reg, _t: wrap_tool(reg, "ticket_update", acts_then_raises)  # noqa: E731
    async with harness(tmp_path, customize=customize) as h:
        lost = await h.start(task_text="t", script=update("T-1", "a"), write_policy=AUTO)
        state = await h.wait_for(lost, lambda s: bool(s.unknown_actions))
        (unknown_id,) = state.unknown_actions
        waiting = await h.start(task_text="t", script=update("T-1", "b"), write_policy=AUTO)
        await h.wait_for(waiting, lambda s: bool(s.blocked_writes))
        # Let its backoff grow: timers of 1, 2, 4, 8 and 16 s fire within 31 s
        # of skipped time, and the 32-s one started then has 23 s to go at 40.
        await h.env.sleep(40)
        assert await backoff_timers(waiting) >= 6
        # From here time runs at its own pace (nothing awaits a result, and
        # the update is awaited with skipping off).
        with h.env.auto_time_skipping_disabled():
            await reconcile(lost, unknown_id, "succeeded")
        # Within a few seconds, not the 23 s left on its timer.
        done = await h.wait_for(waiting, lambda s: s.status == "completed", within=8)
        assert done.blocked_writes == {} and done.blocked_reason is None
    log = await h.tickets.write_log()
    assert [(w["ticket_id"], w["fencing_token"]) for w in log] == [("T-1", 1), ("T-1", 2)]


async def test_a_busy_write_runs_as_soon_as_the_holder_finishes(tmp_path) -> None:
    """Real time: the holder's write takes 10 s; the waiter's timers fire at
    about 1, 3, 7 and 15 s. Woken when the holder's write ends, the waiter's
    write starts at once, not 5 s later when its timer fires."""
    async with harness(tmp_path, write_delay=10.0) as h:
        holder = await h.start(task_text="t", script=update("T-1", "a"), write_policy=AUTO)
        await until_executing(h, holder)  # it holds T-1's lease before the other asks
        waiting = await h.start(task_text="t", script=update("T-1", "b"), write_policy=AUTO)
        with h.env.auto_time_skipping_disabled():
            await holder.result()
            await waiting.result()
    log = await h.tickets.write_log()
    first, second = sorted(log, key=lambda w: w["fencing_token"])
    at = datetime.fromisoformat
    gap = (at(second["started_at"]) - at(first["finished_at"])).total_seconds()
    assert 0 <= gap < 2.5, gap  # never overlapped; and no timer sat out
