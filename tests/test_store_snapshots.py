"""Views read one consistent snapshot: a run read while its seats' writes are
intercepted never meets an approval whose action it has not seen."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from roundtable.store import Store
from roundtable.store.schema import RunRow
from roundtable.views import run_view
from tests.helpers import new_run, waiting_action

WRITES = 40


async def test_run_view_while_writes_are_intercepted_never_sees_half_a_write(
    store: Store,
) -> None:
    """Once a 500 about one time in six: actions were read, then approvals in
    another transaction, and an approval of an action created in between
    raised KeyError."""
    run = await new_run(store)
    expires = datetime.now(UTC) + timedelta(hours=1)
    writing = True

    async def intercept_writes() -> None:
        nonlocal writing
        try:
            for n in range(WRITES):
                await waiting_action(store, run, f"task-{n}", expires)
        finally:
            writing = False

    async def read_views() -> int:
        reads = 0
        while writing or reads == 0:
            view = await run_view(store, run["id"])
            shown = {a["id"] for a in view["actions"]}
            # Every approval's action is in the same view, and the other way round.
            assert {a["action_id"] for a in view["approvals"]} == shown
            assert all("arguments_digest" in a for a in view["approvals"])
            reads += 1
        return reads

    _, *reads = await asyncio.gather(intercept_writes(), read_views(), read_views(), read_views())
    assert min(reads) >= 1
    final = await run_view(store, run["id"])
    assert len(final["actions"]) == len(final["approvals"]) == WRITES


async def test_rows_read_in_a_snapshot_stay_readable_after_it(store: Store) -> None:
    """A snapshot ends by rolling back, which expires the rows it loaded: they
    are let go of first, so what was read is still there after the block (the
    decision context of an edited decision is read so; found by the second
    review of the rollback)."""
    run = await new_run(store)
    action = await waiting_action(store, run, "task-1", datetime.now(UTC) + timedelta(hours=1))
    async with store.db.snapshot() as session:
        row = await session.get(RunRow, run["id"])
    assert row is not None and row.id == run["id"]
    context = await store.decision_context(action["approval_id"])
    assert context is not None
