"""The ORM versions of the decision and of a write's outcome, as they were
before 0dc49cf and 49e3f3c (``git show 0dc49cf^:roundtable/store/approvals.py``,
``git show 49e3f3c^:roundtable/store/leases.py``), kept here only so the
review tests can run old and new on the same inputs and compare what each
leaves in the database. Built from the helpers those versions called, which
are still in the store (``Approvals._apply_decision`` / ``_expire_locked``,
``Leases._attempt_reported`` / ``_end_attempt``), and from the ORM form of
the carried run status (``carry_run_status`` below), which the store no
longer has since its own writes moved to Core statements (f1c1edd)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from roundtable import chaos_hook
from roundtable.states import (
    APPROVAL_DECISIONS,
    TERMINAL_RESULT_STATUSES,
    ActionStatus,
    RunStatus,
)
from roundtable.store.approvals import require_digest, require_pending
from roundtable.store.engine import database_now
from roundtable.store.errors import ConflictError, InvalidInputError
from roundtable.store.rows import require_text, row_to_dict
from roundtable.store.run_status import carried_target, move_run, still_waiting_statement
from roundtable.store.schema import ActionLeaseRow, ActionRow, ApprovalRow, RunRow
from roundtable.store.text import escape_text, refuse_unstorable


async def old_decide(
    store: Any,
    approval_id: str,
    decision: str,
    decided_by: str,
    reason: str | None = None,
    *,
    arguments_digest: str | None = None,
    run_status: str | None = None,
    guard: Callable[[str, str], None] | None = None,
) -> dict[str, Any]:
    self = store.approvals
    if decision not in APPROVAL_DECISIONS:
        raise InvalidInputError("decision must be 'approved' or 'rejected'")
    require_text("decided_by", decided_by)
    refuse_unstorable("reason", reason)
    expired_late = False
    async with self.db.transaction() as session:
        run, approval = await self.db.lock_row(session, ApprovalRow, approval_id)
        action = None
        if guard is not None or arguments_digest is not None:
            action = await session.get(ActionRow, approval.action_id)
        if guard is not None and action is not None:
            guard(run.user_id, action.risk_level)
        require_pending(approval)
        if arguments_digest is not None:
            require_digest(action, arguments_digest)
        now = await database_now(session)
        if now >= approval.expires_at:
            expired_late = await self._expire_locked(session, run, approval, now)
        else:
            await self._apply_decision(session, run, approval, decision, decided_by, reason, now)
            await carry_run_status(session, run, run_status, now)
            decided_row, action_status = (
                await session.execute(
                    select(ApprovalRow, ActionRow.status)
                    .join(ActionRow, ActionRow.id == ApprovalRow.action_id)
                    .where(ApprovalRow.id == approval_id)
                    .execution_options(populate_existing=True)
                )
            ).one()
            decided = row_to_dict(decided_row)
            decided.update(action_status=str(action_status), run_status=str(run.status))
    if expired_late:
        raise ConflictError(f"approval {approval_id!r} expired before the decision arrived")
    return decided


async def old_record_result(
    store: Any,
    action_id: str,
    status: str,
    result: dict[str, Any] | None = None,
    *,
    fencing_token: int | None = None,
    external_object_id: str | None = None,
    attempt_over: bool = False,
) -> bool:
    self = store.leases
    if status not in TERMINAL_RESULT_STATUSES:
        raise InvalidInputError("status must be succeeded, failed or unknown")
    if result is not None and not isinstance(result, dict):
        raise InvalidInputError("result must be a JSON object")
    async with self.db.transaction() as session:
        run, action, now = await self.db.lock_row_and_clock(session, ActionRow, action_id)
        if fencing_token is not None and action.fencing_token != fencing_token:
            return False
        if action.status == ActionStatus.UNKNOWN:
            await self._attempt_reported(session, run, action, status, result)
            if attempt_over:
                await self._end_attempt(session, run, action)
            return False
        if action.status != ActionStatus.EXECUTING:
            return False
        values: dict[str, Any] = {
            "status": status,
            "result": result,
            "finished_at": now,
            "updated_at": now,
        }
        if external_object_id is not None:
            values["external_object_id"] = escape_text(external_object_id)
        if not await self.db.move_action(session, action_id, (ActionStatus.EXECUTING,), values):
            return False
        if status != ActionStatus.UNKNOWN:
            await session.execute(
                delete(ActionLeaseRow).where(ActionLeaseRow.action_id == action_id)
            )
        elif attempt_over:
            await self._end_attempt(session, run, action, audit=False)
        payload: dict[str, Any] = {"action_id": action_id, "fencing_token": action.fencing_token}
        if isinstance((result or {}).get("error_code"), str):
            payload["error_code"] = result["error_code"]  # type: ignore[index]
        await self.db.audit(session, run, f"action.{status}", payload, now)
        chaos_hook.maybe_fail("record_result")
    return True


async def carry_run_status(
    session: AsyncSession, run: RunRow, status: str | None, now: datetime
) -> str:
    """What a write's own transaction tells the run: move it to ``status`` when
    its state machine allows (a live run between running and waiting_input),
    leave it where it is otherwise (ended, say: the workflow's own publish
    then has the last word). Returns the status the run holds now."""
    target = carried_target(RunStatus(run.status), status)
    if target is not None:
        waiting = (
            target == RunStatus.RUNNING
            and (await session.execute(still_waiting_statement(), {"run_id": run.id})).scalar()
        )
        if not waiting:
            await move_run(session, run, target, None, now)
    return str(run.status)
