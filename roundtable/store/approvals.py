"""Approvals: requested once, decided, extended or expired exactly once
(compare-and-set under the run lock). The rules a decision must pass
(``require_pending``, ``require_digest``) live here, once. (Over 400 lines:
each of an approval's transitions, with its checks, is here and nowhere else.)"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from roundtable.completion import complete_every_public_coroutine
from roundtable.config import load_settings
from roundtable.security import (
    Target,
    argument_changes,
    decrypt_arguments,
    encrypt_arguments,
    redact_arguments,
)
from roundtable.security import arguments_digest as digest_arguments
from roundtable.states import (
    APPROVAL_DECISIONS,
    ActionStatus,
    ApprovalStatus,
)
from roundtable.store import commit_notes
from roundtable.store.database import Database, logged_payload
from roundtable.store.decision import (
    action_after_decision,
    action_after_expiry,
    decide_on_connection,
    decided_values,
    decision_payload,
    edit_dedupe_key,
    edit_key_prefix,
    expired_values,
    expiry_payload,
    request_dedupe_key,
    same_actor,
)
from roundtable.store.engine import database_now
from roundtable.store.errors import ConflictError, InvalidInputError, NotFoundError
from roundtable.store.rows import new_id, require_aware, require_text, row_to_dict
from roundtable.store.schema import (
    ActionRow,
    ActionSecretRow,
    ApprovalRow,
    AuditEventRow,
    RunRow,
)
from roundtable.store.text import refuse_unstorable


def require_pending(approval: ApprovalRow) -> None:
    """Only a pending approval may be decided, edited or extended."""
    if approval.status != ApprovalStatus.PENDING:
        raise ConflictError(f"approval {approval.id!r} is already {approval.status}")


def require_digest(action: ActionRow | None, arguments_digest: str) -> None:
    """A decision names the arguments it saw; the action must still hold them."""
    if action is None or action.arguments_digest != arguments_digest:
        raise ConflictError(
            "arguments_digest does not match the action's arguments; "
            "re-read the approval before deciding"
        )


def requested_payload(approval_id: str, action_id: str, expires_at: datetime) -> dict[str, Any]:
    """What the audit log says of an approval opened: ``approval.requested``."""
    return {
        "approval_id": approval_id,
        "action_id": action_id,
        "expires_at": expires_at.isoformat(),
    }


@complete_every_public_coroutine
class Approvals:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def open_locked(
        self,
        session: AsyncSession,
        run: RunRow,
        action: ActionRow,
        expires_at: datetime,
        now: datetime,
    ) -> ApprovalRow:
        """Open the approval of a waiting action (caller holds the run lock)."""
        if expires_at <= now:
            raise InvalidInputError("expires_at must be in the future")
        approval = ApprovalRow(
            id=new_id(),
            action_id=action.id,
            run_id=run.id,
            status=ApprovalStatus.PENDING,
            expires_at=expires_at,
            created_at=now,
            updated_at=now,
        )
        session.add(approval)
        action.approval_id = approval.id
        action.updated_at = now
        await self.db.audit(
            session,
            run,
            "approval.requested",
            requested_payload(approval.id, action.id, expires_at),
            now,
        )
        return approval

    async def create(self, *, action_id: str, expires_at: datetime) -> dict[str, Any]:
        require_aware("expires_at", expires_at)
        async with self.db.transaction() as session:
            run, action = await self.db.lock_row(session, ActionRow, action_id)
            if action.status != ActionStatus.WAITING_APPROVAL:
                raise ConflictError(
                    f"action {action_id!r} is {action.status}; only a waiting_approval "
                    "action can ask for approval"
                )
            open_approval = (
                await session.execute(
                    select(ApprovalRow.id).where(
                        ApprovalRow.action_id == action_id,
                        ApprovalRow.status == ApprovalStatus.PENDING,
                    )
                )
            ).scalar_one_or_none()
            if open_approval is not None:
                raise ConflictError(f"action {action_id!r} already has pending approval")
            approval = await self.open_locked(
                session, run, action, expires_at, await database_now(session)
            )
        return row_to_dict(approval)

    async def get(self, approval_id: str) -> dict[str, Any]:
        return await self.db.get(ApprovalRow, approval_id)

    async def list(
        self, *, run_id: str | None = None, status: str | None = None
    ) -> list[dict[str, Any]]:
        """Observational: an overdue approval reads ``pending`` until expired by
        its workflow timer or the sweep. Listing never changes anything."""
        if status is not None and status not in set(ApprovalStatus):
            raise InvalidInputError(f"unknown approval status {status!r}")
        query = select(ApprovalRow).order_by(ApprovalRow.created_at, ApprovalRow.id)
        if run_id is not None:
            query = query.where(ApprovalRow.run_id == run_id)
        if status is not None:
            query = query.where(ApprovalRow.status == status)
        return await self.db.all(query)

    async def decide(
        self,
        approval_id: str,
        decision: str,
        decided_by: str,
        reason: str | None = None,
        arguments_digest: str | None = None,
        run_status: str | None = None,
        guard: Callable[[str, str], None] | None = None,
        request_key: str | None = None,
    ) -> dict[str, Any]:
        """Approve or reject a pending approval, exactly once.

        A non-pending approval is a :class:`ConflictError`. So is one whose
        deadline has passed by the database clock: it is expired on the spot
        (and stays expired), so a late click can never approve a stale write.
        With ``arguments_digest``, a decision about other arguments than the
        action now holds is a conflict too (checked under the run lock).
        ``run_status``: what the run shows once this decision is recorded (its
        workflow's word), set in the same transaction (see carry_run_status_on).
        ``guard(run owner, risk level)``: who may decide, checked first, on the
        locked rows; whatever it raises refuses the decision.

        ``request_key`` (the asking update's id): the decision is recorded
        under it; a call that finds this request's decision recorded (its
        first attempt committed, and its answer was lost) changes nothing and
        answers with the approval as it stands, not with a conflict.

        Returns the approval as decided, with ``action_status`` (its action's
        status now) and ``run_status`` (the run's), read in the same transaction.
        """
        if decision not in APPROVAL_DECISIONS:
            raise InvalidInputError("decision must be 'approved' or 'rejected'")
        require_text("decided_by", decided_by)
        refuse_unstorable("reason", reason)
        async with self.db.core_transaction() as (connection, notes):
            decided = await decide_on_connection(
                connection,
                notes,
                approval_id,
                decision,
                decided_by,
                reason,
                arguments_digest,
                run_status,
                guard,
                request_key,
            )
        if decided is None:  # expired instead, and committed so
            raise ConflictError(f"approval {approval_id!r} expired before the decision arrived")
        return decided

    async def approve_with_edits(
        self,
        approval_id: str,
        decided_by: str,
        reason: str | None,
        arguments_digest: str | None,
        arguments: dict[str, Any],
        target: Target,
        *,
        request_key: str | None = None,
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Approve with corrected arguments (already validated by the caller
        against the tool's schema and policy, ``target`` re-derived from them).
        Returns the approval as decided, with ``action_status``, and the
        changes, redacted as the action's view is: all of it as the
        transaction wrote it, nothing read after its commit. A read after it
        that failed (a pool starved, a connection lost) would fail the
        caller's activity with the decision already recorded, and its retry
        would find the approval decided and answer a conflict, the edits
        lost to the seat. ``request_key`` (the asking update's id): the edit
        is recorded under it, and a call with a key already recorded (an
        attempt retried after the first committed) answers with that record,
        changing nothing."""
        require_text("decided_by", decided_by)
        refuse_unstorable("reason", reason)
        key = request_dedupe_key("action.arguments_edited", approval_id, request_key)
        async with self.db.transaction() as session:
            run, approval = await self.db.lock_row(session, ApprovalRow, approval_id)
            action = await session.get(ActionRow, approval.action_id)
            recorded = await logged_payload(session, run.id, key) if key else None
            if recorded is not None:  # this request's own edit, committed before
                same_actor(recorded, "edited_by", decided_by)
                return _answered(approval, str(action.status)), recorded["changes"]
            require_pending(approval)
            if action.status != ActionStatus.WAITING_APPROVAL:
                # Unreachable while a pending approval's action always waits
                # for it; refused rather than edit the arguments of a write
                # that may be under way.
                raise ConflictError(
                    f"action {action.id!r} is {action.status}, not waiting for approval"
                )
            if arguments_digest is not None:
                require_digest(action, arguments_digest)
            now = await database_now(session)
            if now >= approval.expires_at:
                raise ConflictError(f"approval {approval_id!r} has already expired")
            secret = await session.get(ActionSecretRow, action.id)
            before = (
                decrypt_arguments(secret.arguments_encrypted, associated_data=action.id.encode())
                if secret is not None
                else {}
            )
            changes = argument_changes(before, arguments, action.safe_argument_fields)
            sealed = encrypt_arguments(arguments, associated_data=action.id.encode())
            if secret is None:
                session.add(
                    ActionSecretRow(action_id=action.id, arguments_encrypted=sealed, created_at=now)
                )
            else:
                secret.arguments_encrypted = sealed
            action.arguments = redact_arguments(arguments, action.safe_argument_fields)
            action.arguments_digest = digest_arguments(action.id, action.tool_name, arguments)
            action.target_key, action.target_scope = target.key, target.scope
            action.target_namespace_wide = target.namespace_wide
            await self.db.audit(
                session,
                run,
                "action.arguments_edited",
                {
                    "action_id": action.id,
                    "approval_id": approval_id,
                    "edited_by": decided_by,
                    "changes": changes,
                },
                now,
                dedupe_key=edit_dedupe_key(approval_id, request_key),
            )
            action_status = await self._apply_decision(
                session, run, approval, ApprovalStatus.APPROVED, decided_by, reason, now
            )
            decided = _answered(
                approval,
                action_status,
                **decided_values(ApprovalStatus.APPROVED, decided_by, reason, now),
            )
        return decided, changes

    async def keyed_change(
        self,
        event_type: str,
        approval_id: str,
        request_key: str | None,
        *,
        actor: str | None = None,
        locked: bool = False,
    ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The change ``request_key`` asked of the approval, if it is recorded
        (``event_type``: approval.extended, action.arguments_edited, or
        approval.approved or approval.rejected for a plain decision): the
        approval as it stands, with its action's status, and the change's
        audit payload (the answer carries the run's status too). None if
        not (or no key), and None if it was recorded for another person than
        ``actor`` (a key chosen to match another's).
        ``locked``: read under the run lock, after any transaction of the
        run still queued or running (an earlier attempt's, say) has ended."""
        key = request_dedupe_key(event_type, approval_id, request_key)
        if key is None:
            return None
        reading = self.db.transaction() if locked else self.db.snapshot()
        async with reading as session:
            if locked:
                run, approval = await self.db.lock_row(session, ApprovalRow, approval_id)
            else:
                approval = await session.get(ApprovalRow, approval_id)
                if approval is None:
                    return None
                run = await session.get(RunRow, approval.run_id)
            payload = await logged_payload(session, approval.run_id, key)
            if payload is None:
                return None
            if actor is not None and payload.get(_ACTOR_FIELDS[event_type]) != actor:
                return None
            action = await session.get(ActionRow, approval.action_id)
            answered = _answered(approval, str(action.status), run_status=str(run.status))
            return answered, payload

    async def standing(
        self,
        approval_id: str,
        *,
        event_type: str | None = None,
        request_key: str | None = None,
        actor: str | None = None,
    ) -> tuple[dict[str, Any], bool, list[dict[str, Any]] | None]:
        """The approval as it stands, with its action's and run's status;
        whether the change ``request_key`` asked (``event_type``, as for
        :meth:`keyed_change`) is the one recorded, for ``actor``; and, once
        it is no longer pending, the changes of its edit if one was made,
        whoever made it (an approval is edited at most once, as it is
        decided: the write goes out with them, so its seat is told, however
        the run learnt of the decision). One snapshot, without the run lock:
        a tool worker frozen inside its transaction must not hold a caller
        waiting, and the decision and its events commit together."""
        key = request_dedupe_key(event_type, approval_id, request_key) if event_type else None
        async with self.db.snapshot() as session:
            approval = await session.get(ApprovalRow, approval_id)
            if approval is None:
                raise NotFoundError(f"approval {approval_id!r} not found")
            run = await session.get(RunRow, approval.run_id)
            action = await session.get(ActionRow, approval.action_id)
            own = await logged_payload(session, run.id, key) if key else None
            ours = own is not None and own.get(_ACTOR_FIELDS[str(event_type)]) == actor
            edits = None
            if approval.status != ApprovalStatus.PENDING:
                # Sought by the (run, dedupe key) index: on SQLite only the
                # run's index entries and the edit's payload are read, never
                # the run's other events (docs/architecture.md says what
                # PostgreSQL reads). An edit a signal made before every edit
                # had a key is not found: its seat is told only by its answer.
                prefix = edit_key_prefix(approval_id)
                edited = await session.execute(
                    select(AuditEventRow.payload)
                    .where(
                        AuditEventRow.run_id == run.id,
                        AuditEventRow.dedupe_key.startswith(prefix, autoescape=True),
                    )
                    .limit(1)
                )
                payload = edited.scalar_one_or_none()
                edits = payload["changes"] if payload is not None else None
            answered = _answered(approval, str(action.status), run_status=str(run.status))
        return answered, ours, edits

    async def extend(
        self,
        approval_id: str,
        seconds: float,
        extended_by: str,
        max_seconds: float,
        *,
        max_extensions: int | None = None,
        max_total_seconds: float | None = None,
        request_key: str | None = None,
    ) -> dict[str, Any]:
        """Push a pending approval's deadline back by ``seconds`` (at most
        ``max_seconds``). An approval already past its deadline stays expired.
        Repeated extensions are bounded: after ``max_extensions`` of them, or
        past ``max_total_seconds`` after the approval was created, it is a
        :class:`ConflictError` (None: the settings' limits). Checked under the
        run lock, so concurrent extensions cannot both slip under a limit.
        Returns the approval as the transaction wrote it, not read after its
        commit: a read that failed there would fail the caller's activity
        with the extension recorded, and its retry would extend again.
        ``request_key`` (the asking update's id): the extension is recorded
        under it, and a call with a key already recorded (an attempt retried
        after the first committed, or cancelled while its transaction still
        ran to its end) answers with the approval as it stands, extending
        nothing."""
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds <= 0:
            raise InvalidInputError("seconds must be a positive number")
        if seconds > max_seconds:
            raise InvalidInputError(f"an extension is at most {int(max_seconds)} seconds")
        require_text("extended_by", extended_by)
        key = request_dedupe_key("approval.extended", approval_id, request_key)
        async with self.db.transaction() as session:
            run, approval = await self.db.lock_row(session, ApprovalRow, approval_id)
            recorded = await logged_payload(session, run.id, key) if key else None
            if recorded is not None:  # this request's, committed before
                same_actor(recorded, "by", extended_by)
                return row_to_dict(approval)
            require_pending(approval)
            now = await database_now(session)
            if now >= approval.expires_at:
                raise ConflictError(f"approval {approval_id!r} has already expired")
            before = approval.expires_at
            after = before + timedelta(seconds=seconds)
            await self._within_extension_limits(
                session, approval, after, max_extensions, max_total_seconds
            )
            approval.expires_at, approval.updated_at = after, now
            extended = row_to_dict(approval)
            await self.db.audit(
                session,
                run,
                "approval.extended",
                {
                    "approval_id": approval_id,
                    "action_id": approval.action_id,
                    "from": before.isoformat(),
                    "to": after.isoformat(),
                    "by": extended_by,
                },
                now,
                dedupe_key=key,
            )
        return extended

    @staticmethod
    async def _within_extension_limits(
        session: AsyncSession,
        approval: ApprovalRow,
        new_deadline: datetime,
        max_extensions: int | None,
        max_total_seconds: float | None,
    ) -> None:
        settings = load_settings() if None in (max_extensions, max_total_seconds) else None
        if max_extensions is None:
            max_extensions = settings.max_approval_extensions
        if max_total_seconds is None:
            max_total_seconds = settings.max_approval_total_seconds
        # The audit log is the record of extensions: no counter to keep in step.
        payloads = await session.execute(
            select(AuditEventRow.payload).where(
                AuditEventRow.run_id == approval.run_id,
                AuditEventRow.event_type == "approval.extended",
            )
        )
        done = sum(1 for p in payloads.scalars() if p.get("approval_id") == approval.id)
        if done >= max_extensions:
            raise ConflictError(
                f"approval {approval.id!r} was already extended {done} time(s); "
                f"at most {max_extensions} extensions are allowed"
            )
        latest = approval.created_at + timedelta(seconds=max_total_seconds)
        if new_deadline > latest:
            raise ConflictError(
                f"approval {approval.id!r} cannot stay open past {latest.isoformat()} "
                f"({int(max_total_seconds)} seconds after it was created)"
            )

    async def _apply_decision(
        self,
        session: AsyncSession,
        run: RunRow,
        approval: ApprovalRow,
        decision: str,
        decided_by: str,
        reason: str | None,
        now: datetime,
    ) -> str:
        """Record ``decision`` on the pending ``approval`` and its action;
        the action's status after it."""
        changed = await self.db.compare_and_set(
            session,
            ApprovalRow,
            approval.id,
            (ApprovalStatus.PENDING,),
            decided_values(decision, decided_by, reason, now),
        )
        if not changed:
            raise ConflictError(f"approval {approval.id!r} is no longer pending")
        commit_notes.approval_settled(session, decision, approval.created_at, now)
        action_values = action_after_decision(decision, now)
        action_status = action_values["status"]
        moved = await self.db.move_action(
            session, approval.action_id, (ActionStatus.WAITING_APPROVAL,), action_values
        )
        if not moved:  # its action no longer waits: refuse, never answer a guess
            raise ConflictError(f"action {approval.action_id!r} is not waiting for approval")
        who = decision_payload(approval.id, approval.action_id, decided_by, reason)
        await self.db.audit(session, run, f"approval.{decision}", who, now)
        await self.db.audit(session, run, f"action.{action_status}", who, now)
        return str(action_status)

    async def _expire_locked(
        self, session: AsyncSession, run: RunRow, approval: ApprovalRow, now: datetime
    ) -> bool:
        changed = await self.db.compare_and_set(
            session,
            ApprovalRow,
            approval.id,
            (ApprovalStatus.PENDING,),
            expired_values(now),
        )
        if not changed:
            return False
        commit_notes.approval_settled(session, ApprovalStatus.EXPIRED, approval.created_at, now)
        await self.db.move_action(
            session, approval.action_id, (ActionStatus.WAITING_APPROVAL,), action_after_expiry(now)
        )
        payload = expiry_payload(approval.id, approval.action_id)
        await self.db.audit(session, run, "approval.expired", payload, now)
        await self.db.audit(session, run, "action.rejected", payload, now)
        return True

    async def expire(self, approval_id: str, deadline: datetime | None = None) -> bool:
        """Expire one approval now: the workflow's own deadline timer is
        authoritative for its run, whatever the database clock says. With
        ``deadline`` (the one the timer was armed for), an approval whose
        deadline has since been extended past it stays pending: the extension
        committed first, so the workflow must wait for the new deadline.
        False if not expired (already decided, or extended)."""
        if deadline is not None:
            require_aware("deadline", deadline)
        async with self.db.transaction() as session:
            run, approval = await self.db.lock_row(session, ApprovalRow, approval_id)
            if deadline is not None and approval.expires_at > deadline:
                return False
            return await self._expire_locked(session, run, approval, await database_now(session))

    async def expire_due(
        self, run_id: str | None = None, now: datetime | None = None
    ) -> list[dict[str, str]]:
        """Expire every pending approval whose deadline is at or before ``now``
        (default: the database clock). Safe to run twice or concurrently: each
        approval is expired by exactly one caller, and only that caller reports it."""
        if now is not None:
            require_aware("now", now)

        def due(cutoff: datetime) -> Any:
            query = select(ApprovalRow.id).where(
                ApprovalRow.status == ApprovalStatus.PENDING, ApprovalRow.expires_at <= cutoff
            )
            if run_id is not None:
                query = query.where(ApprovalRow.run_id == run_id)
            return query.order_by(ApprovalRow.expires_at)

        async def settle(session: AsyncSession, approval_id: str) -> dict[str, str] | None:
            run, approval = await self.db.lock_row(session, ApprovalRow, approval_id)
            db_clock = await database_now(session)
            if approval.expires_at > (now or db_clock):
                return None  # extended meanwhile
            if not await self._expire_locked(session, run, approval, db_clock):
                return None
            return {"id": approval.id, "run_id": approval.run_id, "action_id": approval.action_id}

        return await self.db.sweep(due, settle, now)

    async def withdraw_pending_locked(
        self, session: AsyncSession, run: RunRow, action: ActionRow, reason: str, now: datetime
    ) -> None:
        """The action's pending approval, if any, is withdrawn (its run ends
        before it was decided; the caller holds the run lock)."""
        withdrawn = (
            await session.execute(
                update(ApprovalRow)
                .where(
                    ApprovalRow.action_id == action.id,
                    ApprovalRow.status == ApprovalStatus.PENDING,
                )
                .values(
                    status=ApprovalStatus.WITHDRAWN,
                    decision_reason=reason,
                    decided_at=now,
                    updated_at=now,
                )
                .returning(ApprovalRow.id)
            )
        ).scalar_one_or_none()
        if withdrawn is not None:
            await self.db.audit(
                session,
                run,
                "approval.withdrawn",
                {"action_id": action.id, "reason": reason, "approval_id": withdrawn},
                now,
            )


# Who each keyed change's audit payload says made it.
_ACTOR_FIELDS = {
    "approval.approved": "decided_by",
    "approval.rejected": "decided_by",
    "action.arguments_edited": "edited_by",
    "approval.extended": "by",
}


def _answered(approval: ApprovalRow, action_status: str, **decided: Any) -> dict[str, Any]:
    """The approval as a call answers it: its row (with ``decided``, what a
    decision changed by a statement of its own), and its action's status."""
    return {**row_to_dict(approval), **decided, "action_status": action_status}
