"""A run's status transition, under the caller's run lock: one home for the
move itself, so the writes that change what a run waits for (a write asking
for approval, a decision) can carry the run's new status in their own
transaction instead of a transaction of its own."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from functools import cache
from typing import Any

from sqlalchemy import bindparam, exists, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from roundtable.states import RUN_TRANSITIONS, ActionStatus, ApprovalStatus, RunStatus
from roundtable.store.audit import append_event
from roundtable.store.core_statements import CoreConnection
from roundtable.store.core_writes import ChainedRun, update_row
from roundtable.store.engine import database_now
from roundtable.store.errors import ConflictError
from roundtable.store.schema import ActionRow, ApprovalRow, RunRow, SessionRow

_SESSIONS = SessionRow.__table__


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


async def move_run_on(
    connection: CoreConnection,
    run: ChainedRun,
    current: RunStatus,
    target: RunStatus,
    failure: dict[str, str] | None,
    held: Mapping[str, Any],
    now: datetime,
) -> bool:
    """:func:`move_run` on a Core connection, for a transaction that writes
    the run through ``run`` (its changes and events go out with
    :meth:`ChainedRun.write`). ``held`` is the run's ``session_id`` and
    ``failure`` as the transaction read them under the run lock. The same
    rules: False if already there, ConflictError for a move the state machine
    does not allow, the session moved with the run, and the failure written
    only when it changes, as the ORM's flush writes it."""
    if target == current:
        return False
    if target not in RUN_TRANSITIONS[current]:
        raise ConflictError(f"run {run.id!r} cannot go from {current} to {target}")
    session_values = {"status": target, "updated_at": now}
    await update_row(connection, _SESSIONS, held["session_id"], session_values, later=True)
    run.changes["status"] = target
    if (failure is not None or current == RunStatus.STALLED) and failure != held["failure"]:
        run.changes["failure"] = failure
    change: dict[str, Any] = {"from": current, "to": target}
    if failure is not None:
        change["failure"] = failure
    run.append("run.status_changed", change, now)
    return True


async def carry_run_status_on(
    connection: CoreConnection,
    run: ChainedRun,
    current: RunStatus,
    status: str | None,
    held: Mapping[str, Any],
    now: datetime,
    *,
    unless_waiting: bool = True,
) -> RunStatus:
    """What a write's own transaction tells the run: move it to ``status`` when
    its state machine allows (a live run between running and waiting_input,
    and to running only while nothing of it still waits), leave it where it
    is otherwise (ended, say: the workflow's own publish then has the last
    word). See :func:`move_run_on` for ``run`` and ``held``. With
    ``unless_waiting`` False, a move to running is made even while something
    of the run still waits: for the run's opening, which replaces the
    workflow's own first status write.
    Returns the run's status now."""
    target = carried_target(current, status)
    if target is None:
        return current
    if unless_waiting and target == RunStatus.RUNNING:
        waiting = await connection.execute(still_waiting_statement(), {"run_id": run.id})
        if waiting.scalar():
            return current
    await move_run_on(connection, run, current, target, None, held, now)
    return target


def carried_target(current: RunStatus, status: str | None) -> RunStatus | None:
    """Where a write's transaction may move a run at ``current`` that its
    workflow says should be at ``status``: None when it stays (no word, the
    same status, or a move its state machine does not allow). A move to
    running also needs nothing of the run still waiting
    (:func:`still_waiting_statement`): the workflow asked before its write
    ran and may not know all the store does."""
    if status is None:
        return None
    target = RunStatus(status)
    if target == current or target not in RUN_TRANSITIONS[current]:
        return None
    return target


@cache
def still_waiting_statement() -> Any:
    """Whether the run ``:run_id`` has an open approval or an unknown action,
    in one query (built once: the ORM and Core paths both run it)."""
    run_id = bindparam("run_id", type_=RunRow.__table__.c.id.type)
    pending = exists().where(
        ApprovalRow.run_id == run_id, ApprovalRow.status == ApprovalStatus.PENDING.value
    )
    unknown = exists().where(
        ActionRow.run_id == run_id, ActionRow.status == ActionStatus.UNKNOWN.value
    )
    return select(or_(pending, unknown))
