"""The lease protocol, in one module as the Spin model (proofs/lease.pml) has
it: claiming a target, holding the lease while the call runs, recording the
result, recovering a lapsed lease. (Over 400 lines on purpose: these steps
are one protocol and are read together.)

The rules (docs/architecture.md, "Safety rules"):
- the lease row's primary key (the target key) admits one holder per target;
- a target with an ``unknown`` action (or an overlapping one, within its
  scope) stays blocked until an operator reconciles it;
- fencing tokens grow per target *and* per scope, so a namespace-wide write
  outranks the per-key writes before it;
- a lease is removed only by a definite result or an operator's reconciliation,
  never by expiry, so clock trouble costs liveness, never safety;
- a lease that expired while its action was executing makes the action
  ``unknown``, and the target stays blocked until reconciled;
- nothing here ever re-executes anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any

from sqlalchemy import and_, delete, false, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from roundtable import chaos_hook
from roundtable.completion import complete_every_public_coroutine
from roundtable.states import (
    FINAL_ACTION_STATUSES,
    LEASE_EXPIRED_ERROR_CODE,
    TERMINAL_RESULT_STATUSES,
    ActionStatus,
    ClaimOutcome,
)
from roundtable.store import commit_notes
from roundtable.store.database import Database, reload
from roundtable.store.engine import database_clock, database_now, insert_for, is_postgresql
from roundtable.store.errors import ConflictError, InvalidInputError
from roundtable.store.rows import require_aware, row_to_dict
from roundtable.store.schema import (
    ActionLeaseRow,
    ActionRow,
    ActionSecretRow,
    RunRow,
    TargetFencingRow,
    TargetScopeRow,
)
from roundtable.store.text import escape_text

MAX_LEASE_SECONDS = 24 * 3600


def _lease_length(lease_seconds: float) -> timedelta:
    if isinstance(lease_seconds, bool) or not isinstance(lease_seconds, int | float):
        raise InvalidInputError("lease_seconds must be a number")
    if not 0 < lease_seconds <= MAX_LEASE_SECONDS:
        raise InvalidInputError(f"lease_seconds must be in (0, {MAX_LEASE_SECONDS}]")
    return timedelta(seconds=lease_seconds)


@dataclass(frozen=True)
class Claim:
    """How a claim ended; when it claimed, the action and its sealed arguments."""

    outcome: ClaimOutcome
    action: dict[str, Any] | None = None
    sealed_arguments: str | None = None


@complete_every_public_coroutine
class Leases:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def claim(self, action_id: str, lease_seconds: float) -> ClaimOutcome:
        """Try to start executing an approved action; see :class:`ClaimOutcome`."""
        return (await self._claim(action_id, lease_seconds, hand_over=False)).outcome

    async def claim_for_execution(self, action_id: str, lease_seconds: float) -> Claim:
        """:meth:`claim`, and when it claims, what the executor needs next,
        read in the claim's own transaction: the action as it now stands
        (executing, with its fencing token) and its sealed arguments."""
        return await self._claim(action_id, lease_seconds, hand_over=True)

    async def _claim(self, action_id: str, lease_seconds: float, hand_over: bool) -> Claim:
        length = _lease_length(lease_seconds)
        async with self.db.transaction() as session:
            run, action = await self.db.lock_row(session, ActionRow, action_id)
            now = await database_now(session)
            if action.status in FINAL_ACTION_STATUSES:
                return Claim(ClaimOutcome.ALREADY_FINISHED)
            if action.status == ActionStatus.UNKNOWN:
                return Claim(ClaimOutcome.UNKNOWN)
            if action.status == ActionStatus.WAITING_APPROVAL:
                return Claim(ClaimOutcome.NOT_APPROVED)
            if action.status == ActionStatus.EXECUTING:
                return Claim(await self._claim_own_executing(session, run, action, now))
            if await target_has_unknown(session, action):
                commit_notes.note(session, commit_notes.LeaseBusy(action.tool_name))
                return Claim(ClaimOutcome.TARGET_RECONCILIATION_REQUIRED)
            outcome = await take_lease(self.db, session, run, action, now, length)
            if outcome == ClaimOutcome.TARGET_BUSY:
                commit_notes.note(session, commit_notes.LeaseBusy(action.tool_name))
            if outcome != ClaimOutcome.CLAIMED or not hand_over:
                return Claim(outcome)
            executing = await reload(session, ActionRow, action_id)
            secret = await session.get(ActionSecretRow, action_id)
            return Claim(
                outcome,
                row_to_dict(executing),
                secret.arguments_encrypted if secret is not None else None,
            )

    async def waiting_on_target(self, action: Mapping[str, Any], limit: int = 3) -> list[str]:
        """The runs with an approved write waiting for ``action``'s target (or
        one that may overlap it): whom to wake when it frees. The ``limit``
        longest waiting, so waiters go roughly in turn, and twenty waiters on
        a hot target do not all claim at every release (a few, in case one
        cannot act; the rest keep their timers). A superset is harmless: a
        woken write that still finds the target taken waits again. ``action``
        is the caller's copy of the row (its target does not change): one
        query, on the write path."""
        target = SimpleNamespace(**action)
        same_or_overlapping = or_(
            ActionRow.target_key == target.target_key,
            _overlaps(target, ActionRow.target_scope, ActionRow.target_namespace_wide),
        )
        async with self.db.reader() as session:
            runs = await session.execute(
                select(ActionRow.run_id)
                .where(
                    same_or_overlapping,
                    ActionRow.status == ActionStatus.APPROVED,
                    ActionRow.id != target.id,
                )
                .group_by(ActionRow.run_id)
                .order_by(func.min(ActionRow.created_at))
                .limit(limit)
            )
            return list(runs.scalars())

    async def _claim_own_executing(
        self, session: AsyncSession, run: RunRow, action: ActionRow, now: datetime
    ) -> ClaimOutcome:
        lease = await lease_of(session, action.id)
        if lease is not None and lease.lease_expires_at > now:
            return ClaimOutcome.IN_PROGRESS
        # Our own lease ran out mid-execution: nobody can know what happened.
        await self.mark_unknown(session, run, action, lease, now)
        return ClaimOutcome.UNKNOWN

    async def mark_unknown(
        self,
        session: AsyncSession,
        run: RunRow,
        action: ActionRow,
        lease: ActionLeaseRow | None,
        now: datetime,
        error_code: str = LEASE_EXPIRED_ERROR_CODE,
    ) -> bool:
        """executing → unknown because the lease lapsed (or the workflow closed
        under it); the lease row stays, blocking the target."""
        result = {"error_code": error_code}
        changed = await self.db.move_action(
            session,
            action.id,
            (ActionStatus.EXECUTING,),
            {
                "status": ActionStatus.UNKNOWN,
                "result": result,
                "finished_at": now,
                "updated_at": now,
            },
        )
        if changed:
            await self.db.audit(
                session,
                run,
                "action.unknown",
                {
                    "action_id": action.id,
                    "fencing_token": lease.fencing_token if lease else action.fencing_token,
                    "error_code": error_code,
                },
                now,
            )
        return changed

    async def renew(self, action_id: str, fencing_token: int, lease_seconds: float) -> bool:
        """Extend a live lease held under ``fencing_token`` of an ``executing``
        action. An expired lease is not renewed: once it lapsed, the action's
        outcome is already in doubt."""
        held = await self._extend_lease(
            action_id, fencing_token, lease_seconds, (ActionStatus.EXECUTING,)
        )
        return held is not None

    async def hold(self, action_id: str, fencing_token: int, lease_seconds: float) -> str | None:
        """What an attempt that is still running does: extend its live lease,
        whether its action is still ``executing`` or was meanwhile made
        ``unknown`` by someone else (its call may still be under way, so the
        target stays held and reconciliation refused). Returns the action's
        status, or None when the lease is lost (lapsed, gone, another token)."""
        return await self._extend_lease(
            action_id,
            fencing_token,
            lease_seconds,
            (ActionStatus.EXECUTING, ActionStatus.UNKNOWN),
        )

    async def _extend_lease(
        self, action_id: str, fencing_token: int, lease_seconds: float, statuses: tuple
    ) -> str | None:
        length = _lease_length(lease_seconds)
        async with self.db.transaction() as session:
            status = (
                await session.execute(select(ActionRow.status).where(ActionRow.id == action_id))
            ).scalar_one_or_none()
            if status not in statuses:
                return None
            # The clock is read by the statement itself on PostgreSQL, after
            # any wait for the row: a lease that lapsed meanwhile is not held.
            now = database_clock(session)
            if now is None:
                now = await database_now(session)
            result = await session.execute(
                update(ActionLeaseRow)
                .where(
                    ActionLeaseRow.action_id == action_id,
                    ActionLeaseRow.fencing_token == fencing_token,
                    ActionLeaseRow.lease_expires_at > now,
                )
                .values(lease_expires_at=now + length)
            )
            # Test-only (chaos harness; inert unless ROUNDTABLE_CHAOS=1): the
            # database fails before this renewal commits.
            chaos_hook.maybe_fail("renew")
            return status if result.rowcount == 1 else None

    async def record_result(
        self,
        action_id: str,
        status: str,
        result: dict[str, Any] | None = None,
        *,
        fencing_token: int | None = None,
        external_object_id: str | None = None,
        attempt_over: bool = False,
    ) -> bool:
        """Record how an execution ended. Only an ``executing`` action changes
        (False otherwise, e.g. recovery already made it ``unknown``). A definite
        result frees the target; ``unknown`` keeps it blocked.

        ``attempt_over``: the executing attempt itself records this, after its
        tool call returned or was cancelled to the end, so nothing of it can
        still be running: the lease's clock stops and the action may be
        reconciled at once. Anyone else (the workflow after the activity
        failed) leaves the lease to run out first. (One transaction whose
        branches are read together: hence its length.)"""
        if status not in TERMINAL_RESULT_STATUSES:
            raise InvalidInputError("status must be succeeded, failed or unknown")
        if result is not None and not isinstance(result, dict):
            raise InvalidInputError("result must be a JSON object")
        async with self.db.transaction() as session:
            run, action = await self.db.lock_row(session, ActionRow, action_id)
            if fencing_token is not None and action.fencing_token != fencing_token:
                return False
            if action.status == ActionStatus.UNKNOWN:
                # Someone made it unknown while the attempt ran (a timeout, a
                # closed run). What the attempt then saw is kept as evidence for
                # whoever reconciles it; the status stays unknown.
                await self._attempt_reported(session, run, action, status, result)
                if attempt_over:  # and it has ended: no need to wait out the lease
                    await self._end_attempt(session, run, action)
                return False
            if action.status != ActionStatus.EXECUTING:
                return False
            now = await database_now(session)
            values: dict[str, Any] = {
                "status": status,
                "result": result,
                "finished_at": now,
                "updated_at": now,
            }
            if external_object_id is not None:
                # From the tool: kept, escaped, rather than failing the write's record.
                values["external_object_id"] = escape_text(external_object_id)
            if not await self.db.move_action(session, action_id, (ActionStatus.EXECUTING,), values):
                return False
            if status != ActionStatus.UNKNOWN:
                await session.execute(
                    delete(ActionLeaseRow).where(ActionLeaseRow.action_id == action_id)
                )
            elif attempt_over:
                await self._end_attempt(session, run, action, audit=False)
            payload: dict[str, Any] = {
                "action_id": action_id,
                "fencing_token": action.fencing_token,
            }
            if isinstance((result or {}).get("error_code"), str):
                payload["error_code"] = result["error_code"]  # type: ignore[index]
            await self.db.audit(session, run, f"action.{status}", payload, now)
            # Test-only (chaos harness; inert unless ROUNDTABLE_CHAOS=1): the
            # database fails before the result commits.
            chaos_hook.maybe_fail("record_result")
        return True

    async def _attempt_reported(
        self,
        session: AsyncSession,
        run: RunRow,
        action: ActionRow,
        status: str,
        result: dict[str, Any] | None,
    ) -> None:
        now = await database_now(session)
        action.result = {
            **(action.result or {}),
            "attempt_reported": {
                "status": status,
                **({"result": result} if result is not None else {}),
            },
        }
        action.updated_at = now
        payload: dict[str, Any] = {
            "action_id": action.id,
            "fencing_token": action.fencing_token,
            "status": status,
        }
        if isinstance((result or {}).get("error_code"), str):
            payload["error_code"] = result["error_code"]  # type: ignore[index]
        await self.db.audit(session, run, "action.attempt_reported", payload, now)

    async def _end_attempt(
        self, session: AsyncSession, run: RunRow, action: ActionRow, audit: bool = True
    ) -> None:
        """The executing attempt has ended: stop its lease's clock. The row
        stays (the target remains blocked until reconciled)."""
        now = await database_now(session)
        ended = await session.execute(
            update(ActionLeaseRow)
            .where(
                ActionLeaseRow.action_id == action.id,
                ActionLeaseRow.fencing_token == action.fencing_token,
                ActionLeaseRow.lease_expires_at > now,
            )
            .values(lease_expires_at=now)
        )
        if audit and ended.rowcount:
            await self.db.audit(
                session,
                run,
                "action.attempt_ended",
                {"action_id": action.id, "fencing_token": action.fencing_token},
                now,
            )

    async def recover_expired(
        self, run_id: str | None = None, now: datetime | None = None
    ) -> list[dict[str, Any]]:
        """Turn every executing action whose lease expired at or before ``now``
        (default: the database clock) into ``unknown``. Never re-executes; the
        targets stay blocked. Returns the actions it changed."""
        if now is not None:
            require_aware("now", now)

        def due(cutoff: datetime) -> Any:
            query = (
                select(ActionLeaseRow.action_id)
                .join(ActionRow, ActionRow.id == ActionLeaseRow.action_id)
                .where(
                    ActionRow.status == ActionStatus.EXECUTING,
                    ActionLeaseRow.lease_expires_at <= cutoff,
                )
            )
            return query if run_id is None else query.where(ActionLeaseRow.run_id == run_id)

        async def settle(session: AsyncSession, action_id: str) -> dict[str, Any] | None:
            run, action = await self.db.lock_row(session, ActionRow, action_id)
            lease = await lease_of(session, action_id)
            db_clock = await database_now(session)
            if lease is None or lease.lease_expires_at > (now or db_clock):
                return None  # renewed meanwhile
            if not await self.mark_unknown(session, run, action, lease, db_clock):
                return None
            await session.flush()
            return row_to_dict(await reload(session, ActionRow, action_id))

        return await self.db.sweep(due, settle, now)

    async def live_action_ids(self) -> set[str]:
        """The actions whose lease has not run out by the database's clock."""
        async with self.db.reader() as session:
            now = await database_now(session)
            rows = await session.execute(
                select(ActionLeaseRow.action_id).where(ActionLeaseRow.lease_expires_at > now)
            )
            return set(rows.scalars())


# ----------------------------------------------------------- claiming a target


async def lease_of(session: AsyncSession, action_id: str) -> ActionLeaseRow | None:
    return (
        await session.execute(
            select(ActionLeaseRow)
            .where(ActionLeaseRow.action_id == action_id)
            .execution_options(populate_existing=True)
        )
    ).scalar_one_or_none()


def _overlaps(action: Any, scope_column: Any, wide_column: Any) -> Any:
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
    """Claim the action's target, in the caller's transaction (the run is
    locked), in three phases: lock the scope and look for overlapping
    holders; insert the lease row, the step that serialises claims; start
    executing under a new fencing token."""
    scope_claims = None
    if action.target_scope is not None:
        now, scope_claims, blocked = await _lock_scope(session, action)
        if blocked is not None:
            return blocked
    if not await _insert_lease(session, run, action, now, length):
        same_key = ActionLeaseRow.target_key == action.target_key
        return await _holder_outcome(session, same_key) or ClaimOutcome.TARGET_BUSY
    await _start_executing(db, session, run, action, now, length, scope_claims)
    return ClaimOutcome.CLAIMED


async def _lock_scope(
    session: AsyncSession, action: ActionRow
) -> tuple[datetime, int, ClaimOutcome | None]:
    """Hold the scope row until commit, so the overlap check and the insert
    after it are one step for every claim in this scope. (A no-op update
    still takes the row lock; ``claims`` only counts claims that succeed, see
    _next_fencing_token.) Returns the time after the lock, the scope's claims
    as the lock found them (stable while it is held), and why an overlapping
    lease stands in the way, if one does."""
    claims = (
        await session.execute(
            insert_for(session, TargetScopeRow)
            .values(scope_key=action.target_scope, claims=0)
            .on_conflict_do_update(
                index_elements=["scope_key"], set_={"claims": TargetScopeRow.claims}
            )
            .returning(TargetScopeRow.claims)
        )
    ).scalar_one()
    # The lock may have been waited for: the lease runs from now, so leases
    # and tokens of one scope are granted in the same order.
    now = await database_now(session)
    overlapping = _overlaps(action, ActionLeaseRow.scope_key, ActionLeaseRow.namespace_wide)
    return now, claims, await _holder_outcome(session, overlapping)


async def _insert_lease(
    session: AsyncSession, run: RunRow, action: ActionRow, now: datetime, length: timedelta
) -> bool:
    """The serialising statement: the target key is the primary key, and an
    existing row (live, expired or blocked) is never taken over."""
    inserted = await session.execute(
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
    return inserted.scalar_one_or_none() is not None


async def _start_executing(
    db: Database,
    session: AsyncSession,
    run: RunRow,
    action: ActionRow,
    now: datetime,
    length: timedelta,
    scope_claims: int | None,
) -> None:
    """approved → executing under the lease just taken, with its token."""
    token = await _next_fencing_token(session, action, scope_claims)
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


async def _next_fencing_token(
    session: AsyncSession, action: ActionRow, scope_claims: int | None
) -> int:
    """The claim's fencing token: larger than every token given before on
    this target *and* in its scope, so a namespace-wide write outranks the
    per-key writes before it (and they it). The scope row (locked since the
    start of the claim) holds the scope's last token, ``scope_claims``; the
    target's own counter may have run ahead of it for keys claimed before
    scopes existed. One upsert takes the larger of the two, one past each."""
    floor = 1 if scope_claims is None else scope_claims + 1
    larger = func.greatest if is_postgresql(session) else func.max  # SQLite: max(a, b)
    token = (
        await session.execute(
            insert_for(session, TargetFencingRow)
            .values(target_key=action.target_key, last_token=floor)
            .on_conflict_do_update(
                index_elements=["target_key"],
                set_={"last_token": larger(TargetFencingRow.last_token + 1, floor)},
            )
            .returning(TargetFencingRow.last_token)
        )
    ).scalar_one()
    if action.target_scope is not None:
        await session.execute(
            update(TargetScopeRow)
            .where(TargetScopeRow.scope_key == action.target_scope)
            .values(claims=token)
        )
    return token
