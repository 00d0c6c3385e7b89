"""A run's status transition, under the caller's run lock: one home for the
move itself, so the writes that change what a run waits for (a write asking
for approval, a decision) can carry the run's new status in their own
transaction instead of a transaction of its own."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import exists, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from roundtable.states import RUN_TRANSITIONS, ActionStatus, ApprovalStatus, RunStatus
from roundtable.store.audit import append_event
from roundtable.store.engine import database_now
from roundtable.store.errors import ConflictError
from roundtable.store.schema import ActionRow, ApprovalRow, RunRow, SessionRow


async def move_run(
    session: AsyncSession,
    run: RunRow,
    target: RunStatus,
    failure: dict[str, str] | None,
    now: datetime | None = None,
) -> bool:
    """Move ``run`` (locked by this transaction) to ``target``, its session
    with it, and log the change; False if it is already there. A move the
    run's state machine does not allow is a :class:`ConflictError`."""
    current = RunStatus(run.status)
    if target == current:
        return False
    if target not in RUN_TRANSITIONS[current]:
        raise ConflictError(f"run {run.id!r} cannot go from {current} to {target}")
    now = now or await database_now(session)
    # The session first, in one statement (no read); the run's own changes
    # go out with its audit event at the next flush.
    with session.no_autoflush:
        await session.execute(
            update(SessionRow)
            .where(SessionRow.id == run.session_id)
            .values(status=target, updated_at=now)
        )
    run.status = target
    run.updated_at = now
    if failure is not None or current == RunStatus.STALLED:
        run.failure = failure
    change: dict[str, Any] = {"from": current, "to": target}
    if failure is not None:
        change["failure"] = failure
    await append_event(session, run, "run.status_changed", change, now)
    return True


async def carry_run_status(
    session: AsyncSession, run: RunRow, status: str | None, now: datetime
) -> str:
    """What a write's own transaction tells the run: move it to ``status`` when
    its state machine allows (a live run between running and waiting_input),
    leave it where it is otherwise (ended, say: the workflow's own publish
    then has the last word). Returns the status the run holds now."""
    if status is not None:
        target = RunStatus(status)
        current = RunStatus(run.status)
        if target != current and target in RUN_TRANSITIONS[current]:
            # The workflow asked before its write ran and may not know all the
            # store does: never "running" while the store still holds an open
            # approval or an unknown action of this run.
            if target != RunStatus.RUNNING or not await _still_waiting(session, run.id):
                await move_run(session, run, target, None, now)
    return str(run.status)


async def _still_waiting(session: AsyncSession, run_id: str) -> bool:
    """Whether the run has an open approval or an unknown action, in one query."""
    pending = exists().where(
        ApprovalRow.run_id == run_id, ApprovalRow.status == ApprovalStatus.PENDING
    )
    unknown = exists().where(ActionRow.run_id == run_id, ActionRow.status == ActionStatus.UNKNOWN)
    return bool((await session.execute(select(or_(pending, unknown)))).scalar())
