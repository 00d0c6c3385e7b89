"""Claiming a target: the lease table's one serialising step, its fencing
tokens, and what stands in a claim's way.

The rules (docs/architecture.md, "Safety rules"):
- the lease row's primary key (the target key) admits one holder per target;
- a target with an ``unknown`` action (or an overlapping one, within its
  scope) stays blocked until an operator reconciles it;
- fencing tokens grow per target *and* per scope, so a namespace-wide write
  outranks the per-key writes before it.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, false, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from roundtable.states import ActionStatus, ClaimOutcome
from roundtable.store.database import Database
from roundtable.store.engine import database_now, insert_for
from roundtable.store.errors import ConflictError
from roundtable.store.schema import (
    ActionLeaseRow,
    ActionRow,
    RunRow,
    TargetFencingRow,
    TargetScopeRow,
)


async def lease_of(session: AsyncSession, action_id: str) -> ActionLeaseRow | None:
    return (
        await session.execute(
            select(ActionLeaseRow)
            .where(ActionLeaseRow.action_id == action_id)
            .execution_options(populate_existing=True)
        )
    ).scalar_one_or_none()


def _overlaps(action: ActionRow, scope_column: Any, wide_column: Any) -> Any:
    """SQL condition: a row of ``action``'s scope whose target may overlap it
    (one of the two is namespace-wide)."""
    if action.target_scope is None:
        return false()
    overlap = scope_column == action.target_scope
    return overlap if action.target_namespace_wide else and_(overlap, wide_column.is_(True))


async def target_has_unknown(session: AsyncSession, action: ActionRow) -> bool:
    """Whether an ``unknown`` action of this target (or one that may
    overlap it) blocks it until reconciled."""
    same_or_overlapping = or_(
        ActionRow.target_key == action.target_key,
        _overlaps(action, ActionRow.target_scope, ActionRow.target_namespace_wide),
    )
    blocker = (
        await session.execute(
            select(ActionRow.id)
            .where(
                same_or_overlapping,
                ActionRow.status == ActionStatus.UNKNOWN,
                ActionRow.id != action.id,
            )
            .limit(1)
        )
    ).scalar_one_or_none()
    return blocker is not None


async def _holder_outcome(session: AsyncSession, condition: Any) -> ClaimOutcome | None:
    """Why the leases matching ``condition`` stand in the way, or None if none do."""
    holders = set(
        (
            await session.execute(
                select(ActionRow.status)
                .join(ActionLeaseRow, ActionLeaseRow.action_id == ActionRow.id)
                .where(condition)
            )
        ).scalars()
    )
    if not holders:
        return None
    if ActionStatus.UNKNOWN in holders:
        return ClaimOutcome.TARGET_RECONCILIATION_REQUIRED
    return ClaimOutcome.TARGET_BUSY


async def take_lease(
    db: Database,
    session: AsyncSession,
    run: RunRow,
    action: ActionRow,
    now: datetime,
    length: timedelta,
) -> ClaimOutcome:
    if action.target_scope is not None:
        # Hold the scope row until commit, so the overlap check below and
        # the insert after it are one step for every claim in this scope.
        # (A no-op update still takes the row lock; ``claims`` only counts
        # claims that succeed, see _next_fencing_token.)
        await session.execute(
            insert_for(session, TargetScopeRow)
            .values(scope_key=action.target_scope, claims=0)
            .on_conflict_do_update(
                index_elements=["scope_key"], set_={"claims": TargetScopeRow.claims}
            )
        )
        # The lock may have been waited for: the lease runs from now, so
        # leases and tokens of one scope are granted in the same order.
        now = await database_now(session)
        overlapping = _overlaps(action, ActionLeaseRow.scope_key, ActionLeaseRow.namespace_wide)
        outcome = await _holder_outcome(session, overlapping)
        if outcome is not None:
            return outcome

    # The serialising statement: the target key is the primary key, and an
    # existing row (live, expired or blocked) is never taken over.
    inserted = (
        await session.execute(
            insert_for(session, ActionLeaseRow)
            .values(
                target_key=action.target_key,
                action_id=action.id,
                run_id=run.id,
                fencing_token=0,
                acquired_at=now,
                lease_expires_at=now + length,
                scope_key=action.target_scope,
                namespace_wide=action.target_namespace_wide,
            )
            .on_conflict_do_nothing(index_elements=["target_key"])
            .returning(ActionLeaseRow.target_key)
        )
    ).scalar_one_or_none()
    if inserted is None:
        same_key = ActionLeaseRow.target_key == action.target_key
        return await _holder_outcome(session, same_key) or ClaimOutcome.TARGET_BUSY

    token = await _next_fencing_token(session, action)
    await session.execute(
        update(ActionLeaseRow)
        .where(ActionLeaseRow.target_key == action.target_key)
        .values(fencing_token=token)
    )
    changed = await db.compare_and_set(
        session,
        ActionRow,
        action.id,
        (ActionStatus.APPROVED,),
        {
            "status": ActionStatus.EXECUTING,
            "fencing_token": token,
            "attempt_count": ActionRow.attempt_count + 1,
            "started_at": now,
            "updated_at": now,
        },
    )
    if not changed:  # impossible under the run lock; refuse rather than guess
        raise ConflictError(f"action {action.id!r} changed while being claimed")
    await db.audit(
        session,
        run,
        "action.executing",
        {
            "action_id": action.id,
            "fencing_token": token,
            "lease_expires_at": (now + length).isoformat(),
        },
        now,
    )
    return ClaimOutcome.CLAIMED


async def _next_fencing_token(session: AsyncSession, action: ActionRow) -> int:
    """The claim's fencing token: larger than every token given before on
    this target *and* in its scope, so a namespace-wide write outranks the
    per-key writes before it (and they it). The scope row (locked since the
    start of the claim) holds the scope's last token; the target's own
    counter may have run ahead of it for keys claimed before scopes existed."""
    target_token = (
        await session.execute(
            insert_for(session, TargetFencingRow)
            .values(target_key=action.target_key, last_token=1)
            .on_conflict_do_update(
                index_elements=["target_key"],
                set_={"last_token": TargetFencingRow.last_token + 1},
            )
            .returning(TargetFencingRow.last_token)
        )
    ).scalar_one()
    if action.target_scope is None:
        return target_token
    scope_claims = (
        await session.execute(
            select(TargetScopeRow.claims).where(TargetScopeRow.scope_key == action.target_scope)
        )
    ).scalar_one()
    token = max(target_token, scope_claims + 1)
    await session.execute(
        update(TargetFencingRow)
        .where(TargetFencingRow.target_key == action.target_key)
        .values(last_token=token)
    )
    await session.execute(
        update(TargetScopeRow)
        .where(TargetScopeRow.scope_key == action.target_scope)
        .values(claims=token)
    )
    return token
