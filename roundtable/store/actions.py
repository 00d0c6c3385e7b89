"""Actions: proposed writes, created once per idempotency key (their full
arguments encrypted beside them), withdrawn when their run ends, and
reconciled by an operator when their outcome is unknown."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from roundtable.completion import complete_every_public_coroutine
from roundtable.security import (
    arguments_digest,
    decrypt_arguments,
    encrypt_arguments,
    redact_arguments,
)
from roundtable.states import (
    DENIED_BY_POLICY,
    INITIAL_ACTION_STATUSES,
    RECONCILE_OUTCOMES,
    ActionStatus,
    ApprovalStatus,
    RunStatus,
)
from roundtable.store import commit_notes
from roundtable.store.approvals import Approvals, requested_payload
from roundtable.store.core_writes import ChainedRun, insert_into, locked_run, write_later
from roundtable.store.database import Database, found, reload
from roundtable.store.engine import database_now
from roundtable.store.errors import (
    AttemptMayBeRunningError,
    ConflictError,
    InvalidInputError,
    NotFoundError,
)
from roundtable.store.leases import lease_of
from roundtable.store.reconcile_requests import (
    RECONCILED,
    REFUSED,
    is_own_reconciliation,
    reconcile_key,
    refusal_payload,
    refuse_answered,
    refuse_late,
    refuse_refused,
    request_answer,
)
from roundtable.store.rows import new_id, require_aware, require_text, row_to_dict
from roundtable.store.run_status import carry_run_status_on
from roundtable.store.schema import ActionLeaseRow, ActionRow, ActionSecretRow, ApprovalRow, RunRow
from roundtable.store.text import refuse_unstorable

RISK_LEVELS = ("R0", "R1", "R2", "R3")
_REQUIRED_FIELDS = (
    "session_id",
    "run_id",
    "agent_id",
    "tool_name",
    "idempotency_key",
    "target_key",
    "risk_level",
    "status",
)
_OPTIONAL_FIELDS = (
    "id",
    "logical_action_id",
    "turn_index",
    "arguments",
    "safe_argument_fields",
    "target_scope",
    "target_namespace_wide",
    "approval_expires_at",
)
_ACTIONS = ActionRow.__table__
_SECRETS = ActionSecretRow.__table__
_APPROVALS = ApprovalRow.__table__

# What makes a repeated idempotency key "the same action" rather than a clash.
_IDENTITY_FIELDS = ("run_id", "agent_id", "tool_name", "target_key")


def _validated_action_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(fields, Mapping):
        raise InvalidInputError("action fields must be a mapping")
    unknown = set(fields) - set(_REQUIRED_FIELDS) - set(_OPTIONAL_FIELDS)
    if unknown:
        raise InvalidInputError(f"unknown action fields: {', '.join(sorted(unknown))}")
    for name in _REQUIRED_FIELDS:
        require_text(name, fields.get(name))
    if fields["risk_level"] not in RISK_LEVELS:
        raise InvalidInputError(f"risk_level must be one of {', '.join(RISK_LEVELS)}")
    if fields["status"] not in INITIAL_ACTION_STATUSES:
        raise InvalidInputError(
            f"a new action starts as waiting_approval or approved, not {fields['status']!r}"
        )
    arguments = fields.get("arguments")
    if arguments is not None and not isinstance(arguments, Mapping):
        raise InvalidInputError("arguments must be a mapping")
    safe = fields.get("safe_argument_fields") or []
    if not isinstance(safe, list | tuple) or not all(isinstance(n, str) for n in safe):
        raise InvalidInputError("safe_argument_fields must be a list of field names")
    scope = fields.get("target_scope")
    if scope is not None:
        require_text("target_scope", scope)
    namespace_wide = fields.get("target_namespace_wide", False)
    if not isinstance(namespace_wide, bool):
        raise InvalidInputError("target_namespace_wide must be true or false")
    if namespace_wide and scope is None:
        raise InvalidInputError("a namespace-wide target needs its target_scope")
    expires_at = fields.get("approval_expires_at")
    if expires_at is not None:
        require_aware("approval_expires_at", expires_at)
        if fields["status"] != ActionStatus.WAITING_APPROVAL:
            raise InvalidInputError("only a waiting_approval action asks for approval")
    turn_index = fields.get("turn_index")
    if turn_index is not None and (not isinstance(turn_index, int) or isinstance(turn_index, bool)):
        raise InvalidInputError("turn_index must be an integer")
    if turn_index is not None and not -(2**31) <= turn_index < 2**31:
        # The column is 32 bits: PostgreSQL refuses more, SQLite keeps it.
        raise InvalidInputError("turn_index is out of range")
    return {**fields, "safe_argument_fields": list(safe), "target_namespace_wide": namespace_wide}


def _new_action_values(
    data: Mapping[str, Any], action_id: str, digest: str | None, now: datetime
) -> dict[str, Any]:
    """The row of a validated new action; its arguments as the public view
    may show them (redacted), a refused one already final."""
    refused = data["status"] == ActionStatus.REJECTED
    return {
        "id": action_id,
        "session_id": data["session_id"],
        "run_id": data["run_id"],
        "agent_id": data["agent_id"],
        "tool_name": data["tool_name"],
        "logical_action_id": data.get("logical_action_id"),
        "turn_index": data.get("turn_index"),
        "risk_level": data["risk_level"],
        "status": data["status"],
        "arguments": redact_arguments(data.get("arguments"), data["safe_argument_fields"]),
        "safe_argument_fields": data["safe_argument_fields"],
        "arguments_digest": digest,
        "result": {"error_code": DENIED_BY_POLICY} if refused else None,
        "finished_at": now if refused else None,
        "attempt_count": 0,
        "target_key": data["target_key"],
        "target_scope": data.get("target_scope"),
        "target_namespace_wide": data["target_namespace_wide"],
        "idempotency_key": data["idempotency_key"],
        "created_at": now,
        "updated_at": now,
    }


async def refuse_unreconcilable(
    session: AsyncSession,
    action: ActionRow,
    asked_at: datetime | None = None,
    not_after: datetime | None = None,
) -> datetime:
    """The one rule for reconciling: only an ``unknown`` action whose attempt
    cannot still be running, by a request whose word was not given while it
    could (``asked_at``: what the operator saw then could still change, and
    an attempt retried, or a copy sent again, later must not make it
    stand), and not past its ``not_after`` (judged first: a request its
    sender gave up on leaves no mark, not even a refusal for time). Returns
    the database time it was checked at."""
    if action.status != ActionStatus.UNKNOWN:
        raise ConflictError(
            f"action {action.id!r} is {action.status}; only unknown actions reconcile"
        )
    now = await database_now(session)
    refuse_late(not_after, now, action.id)
    lease = await lease_of(session, action.id)
    if lease is not None and lease.lease_expires_at > now:
        # Its attempt may still be running (a frozen or partitioned
        # worker): whatever the operator saw in the real system could
        # still change, and a successor's claim would make two writers.
        raise AttemptMayBeRunningError(action.id, lease.lease_expires_at)
    if lease is not None and asked_at is not None and asked_at < lease.lease_expires_at:
        raise ConflictError(
            f"this reconciliation of action {action.id!r} was asked at {asked_at.isoformat()}, "
            f"while its attempt could still run (until {lease.lease_expires_at.isoformat()}): "
            "what was seen then could still change; reconcile again, as a new request"
        )
    return now


@complete_every_public_coroutine
class Actions:
    def __init__(self, db: Database, approvals: Approvals) -> None:
        self.db, self.approvals = db, approvals

    async def create(
        self, fields: Mapping[str, Any], run_status: str | None = None
    ) -> dict[str, Any]:
        """Persist a proposed write. The same idempotency key for the same call
        returns the existing action; for a different call it is a conflict.

        A new action waiting for approval also opens its approval; then
        ``run_status`` (what its run shows while it waits) is set in the same
        transaction, and the answer carries ``approval_expires_at`` and
        ``run_status`` (as that transaction left them). An action found again
        carries neither: its caller reads what it needs."""
        data = _validated_action_fields(fields)
        existing = await self.find_by_idempotency_key(data["idempotency_key"])
        if existing is not None:
            return self._same_action_or_conflict(existing, data)
        try:
            return await self._insert_action(data, run_status)
        except IntegrityError:
            # Lost a race with an identical insert: answer as if we came second.
            existing = await self.find_by_idempotency_key(data["idempotency_key"])
            if existing is None:
                raise
            return self._same_action_or_conflict(existing, data)

    @staticmethod
    def _same_action_or_conflict(existing: dict[str, Any], data: Mapping[str, Any]) -> dict:
        if all(existing[name] == data[name] for name in _IDENTITY_FIELDS):
            return existing
        raise ConflictError("idempotency key already belongs to a different action")

    async def find_by_idempotency_key(self, key: str) -> dict[str, Any] | None:
        """The action recorded for this write call, if any."""
        return await self.db.find(ActionRow, "idempotency_key", key)

    async def _insert_action(
        self, data: Mapping[str, Any], run_status: str | None
    ) -> dict[str, Any]:
        action_id = data.get("id") or new_id()
        arguments = data.get("arguments")
        # Encrypt before opening the transaction: no secret, nothing written.
        sealed = (
            encrypt_arguments(arguments, associated_data=action_id.encode())
            if arguments is not None
            else None
        )
        digest = (
            arguments_digest(action_id, data["tool_name"], arguments)
            if arguments is not None
            else None
        )
        expires_at = data.get("approval_expires_at")
        async with self.db.core_transaction() as (connection, notes):
            held, now = await locked_run(connection, data["run_id"])
            if held["session_id"] != data["session_id"]:
                raise InvalidInputError("session_id does not match the run's session")
            if expires_at is not None and expires_at <= now:
                raise InvalidInputError("expires_at must be in the future")
            row = _new_action_values(data, action_id, digest, now)
            approval: dict[str, Any] | None = None
            if expires_at is not None:
                approval = {
                    "id": new_id(),
                    "action_id": action_id,
                    "run_id": data["run_id"],
                    "status": ApprovalStatus.PENDING,
                    "expires_at": expires_at,
                    "created_at": now,
                    "updated_at": now,
                }
                row["approval_id"] = approval["id"]
            # The action first: its secret, its approval and its events refer to it.
            await write_later(connection, insert_into(_ACTIONS), row)
            if row["status"] == ActionStatus.REJECTED:  # refused by the policy: ends here
                notes.append(commit_notes.ActionEnded(row["tool_name"], row["status"]))
            if sealed is not None:
                secret = {"action_id": action_id, "arguments_encrypted": sealed, "created_at": now}
                await write_later(connection, insert_into(_SECRETS), secret)
            run = ChainedRun(held["id"], held["last_event_seq"], held["last_event_hash"])
            created = ("agent_id", "tool_name", "risk_level", "status", "logical_action_id")
            run.append(
                "action.created",
                {
                    "action_id": action_id,
                    **{name: row[name] for name in created},
                    "turn_index": row["turn_index"],
                },
                now,
            )
            opened: dict[str, Any] = {}
            if approval is not None:
                await write_later(connection, insert_into(_APPROVALS), approval)
                said = requested_payload(approval["id"], action_id, expires_at)
                run.append("approval.requested", said, now)
                shown = await carry_run_status_on(
                    connection, run, RunStatus(held["status"]), run_status, held, now
                )
                opened = {"approval_expires_at": expires_at, "run_status": str(shown)}
            await run.write(connection, now)
        return {**{column.key: row.get(column.key) for column in _ACTIONS.c}, **opened}

    async def get(self, action_id: str) -> dict[str, Any]:
        return await self.db.get(ActionRow, action_id)

    async def list(self, run_id: str) -> list[dict[str, Any]]:
        async with self.db.reader() as session:
            await found(session, RunRow, run_id)
            rows = (
                await session.execute(
                    select(ActionRow)
                    .where(ActionRow.run_id == run_id)
                    .order_by(ActionRow.created_at, ActionRow.id)
                )
            ).scalars()
            return [row_to_dict(row) for row in rows]

    async def arguments(self, action_id: str) -> dict[str, Any]:
        """The full, decrypted arguments: for the executor only, never for display."""
        async with self.db.reader() as session:
            row = await session.get(ActionSecretRow, action_id)
            if row is None:
                raise NotFoundError(f"no stored arguments for action {action_id!r}")
            sealed = row.arguments_encrypted
        return decrypt_arguments(sealed, associated_data=action_id.encode())

    async def withdraw(self, action_id: str, reason: str) -> dict[str, Any]:
        """The run ends before this write could run: a pending approval is
        withdrawn and a waiting or approved (never claimed) action rejected,
        with ``reason``. An action already executing or settled is left as it
        is. Returns the action as it now stands."""
        require_text("reason", reason)
        async with self.db.transaction() as session:
            run, action = await self.db.lock_row(session, ActionRow, action_id)
            if action.status not in (ActionStatus.WAITING_APPROVAL, ActionStatus.APPROVED):
                return row_to_dict(action)
            now = await database_now(session)
            payload = {"action_id": action.id, "reason": reason}
            if action.status == ActionStatus.WAITING_APPROVAL:
                await self.approvals.withdraw_pending_locked(session, run, action, reason, now)
            await self.db.move_action(
                session,
                action.id,
                (ActionStatus.WAITING_APPROVAL, ActionStatus.APPROVED),
                {
                    "status": ActionStatus.REJECTED,
                    "result": {"error_code": reason},
                    "finished_at": now,
                    "updated_at": now,
                },
            )
            await self.db.audit(session, run, "action.rejected", payload, now)
            await session.flush()
            refreshed = await session.get(ActionRow, action.id, populate_existing=True)
            return row_to_dict(refreshed)

    async def check_reconcilable(
        self,
        action_id: str,
        request_id: str | None = None,
        not_after: datetime | None = None,
        asked_at: datetime | None = None,
    ) -> dict[str, Any]:
        """The action, if it may be reconciled now by this request; else the
        error :meth:`reconcile` would raise. Nothing is written."""
        async with self.db.reader() as session:
            action = await found(session, ActionRow, action_id)
            key = reconcile_key(action_id, request_id)
            refuse_refused(await request_answer(session, action.run_id, key), action_id)
            await refuse_unreconcilable(session, action, asked_at, not_after)
            return row_to_dict(action)

    async def reconcile_clock(self) -> datetime:
        """Now, by the database's clock, the one a reconciliation's
        ``asked_at`` and ``not_after`` are judged by (its sender's clock may
        be wrong; a wait measured from having read this one is not)."""
        async with self.db.reader() as session:
            return await database_now(session)

    async def reconcile(
        self,
        action_id: str,
        outcome: str,
        decided_by: str,
        note: str | None = None,
        fenced_below: int | None = None,
        request_id: str | None = None,
        not_after: datetime | None = None,
        asked_at: datetime | None = None,
    ) -> dict[str, Any]:
        """An operator settles an ``unknown`` action; its target is freed.
        ``fenced_below``: the tool was told to refuse writes of this target
        with a fencing token below it (so a frozen attempt cannot land late).
        ``request_id``: the operator's request, under which the answer is
        kept (reconcile_requests.py): asked again after it committed, the
        action is answered as it stands; a request refused before, or made
        for another person, is refused, as is one past ``not_after`` (the
        database's clock) or ``asked_at`` while the attempt could still run
        (:func:`refuse_unreconcilable`)."""
        if outcome not in RECONCILE_OUTCOMES:
            raise InvalidInputError("outcome must be 'succeeded' or 'failed'")
        require_text("decided_by", decided_by)
        refuse_unstorable("note", note)
        key = reconcile_key(action_id, request_id)
        async with self.db.transaction() as session:
            run, action = await self.db.lock_row(session, ActionRow, action_id)
            answer = await request_answer(session, run.id, key)
            if answer is not None:
                refuse_answered(answer, action_id, outcome, decided_by)
                return row_to_dict(action)  # this request's, committed before
            now = await refuse_unreconcilable(session, action, asked_at, not_after)
            result = {
                **(action.result or {}),
                "reconciled_outcome": outcome,
                "reconciled_by": decided_by,
                "reconciliation_note": note,
                **({"fenced_below": fenced_below} if fenced_below is not None else {}),
            }
            if not await self.db.move_action(
                session,
                action_id,
                (ActionStatus.UNKNOWN,),
                {"status": outcome, "result": result, "updated_at": now},
            ):
                raise ConflictError(f"action {action_id!r} is no longer unknown")
            await session.execute(
                delete(ActionLeaseRow).where(ActionLeaseRow.action_id == action_id)
            )
            await self.db.audit(
                session,
                run,
                RECONCILED,
                {
                    "action_id": action_id,
                    "outcome": outcome,
                    "decided_by": decided_by,
                    "note": note,
                    **({"fenced_below": fenced_below} if fenced_below is not None else {}),
                },
                now,
                dedupe_key=key,
            )
            await session.flush()
            return row_to_dict(await reload(session, ActionRow, action_id))

    async def refuse_reconcile(
        self,
        action_id: str,
        request_id: str | None,
        decided_by: str,
        outcome: str,
        retry_at: datetime,
    ) -> dict[str, Any] | None:
        """Keep the answer to a request refused because the action's attempt
        could still run until ``retry_at``, so that the request, sent again
        later by anyone who read it, is not taken. Returns the action when
        this request's own reconciliation is recorded instead (a copy of it
        landed in between: it stood, and its operator is told so); else
        None."""
        key = reconcile_key(action_id, request_id)
        if key is None:
            return None
        async with self.db.transaction() as session:
            run, action = await self.db.lock_row(session, ActionRow, action_id)
            answer = await request_answer(session, run.id, key)
            if answer is not None:
                mine = is_own_reconciliation(answer, decided_by, outcome)
                return row_to_dict(action) if mine else None
            now = await database_now(session)
            said = refusal_payload(action_id, outcome, decided_by, retry_at, now)
            await self.db.audit(session, run, REFUSED, said, now, dedupe_key=key)
        return None

    async def reconciled_by_request(
        self,
        action_id: str,
        request_id: str | None,
        decided_by: str,
        outcome: str,
        *,
        locked: bool = False,
    ) -> dict[str, Any] | None:
        """The action as it stands if ``request_id``'s reconciliation, for
        ``decided_by`` and ``outcome``, is recorded; else None (none, or
        another's). ``locked``: read under the run lock, after any
        transaction of the run still under way (an earlier attempt's)."""
        key = reconcile_key(action_id, request_id)
        reading = self.db.transaction() if locked else self.db.snapshot()
        async with reading as session:
            if locked:
                _, action = await self.db.lock_row(session, ActionRow, action_id)
            else:
                action = await found(session, ActionRow, action_id)
            answer = await request_answer(session, action.run_id, key)
            mine = is_own_reconciliation(answer, decided_by, outcome)
            return row_to_dict(action) if mine else None
