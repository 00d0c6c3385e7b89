"""Creating and reading actions; their full arguments live encrypted beside them."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from roundtable.security import (
    arguments_digest,
    decrypt_arguments,
    encrypt_arguments,
    redact_arguments,
)
from roundtable.store.core import StoreCore, new_id, require_aware, require_text, row_to_dict
from roundtable.store.engine import database_now
from roundtable.store.errors import ConflictError, InvalidInputError, NotFoundError
from roundtable.store.schema import ActionRow, ActionSecretRow, ApprovalRow, RunRow
from roundtable.store.states import (
    DENIED_BY_POLICY,
    INITIAL_ACTION_STATUSES,
    ActionStatus,
    ApprovalStatus,
)

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
    return {**fields, "safe_argument_fields": list(safe), "target_namespace_wide": namespace_wide}


class ActionOps(StoreCore):
    async def create_action(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """Persist a proposed write. The same idempotency key for the same call
        returns the existing action; for a different call it is a conflict."""
        data = _validated_action_fields(fields)
        existing = await self._find_by_idempotency_key(data["idempotency_key"])
        if existing is not None:
            return self._same_action_or_conflict(existing, data)
        try:
            return await self._insert_action(data)
        except IntegrityError:
            # Lost a race with an identical insert: answer as if we came second.
            existing = await self._find_by_idempotency_key(data["idempotency_key"])
            if existing is None:
                raise
            return self._same_action_or_conflict(existing, data)

    @staticmethod
    def _same_action_or_conflict(existing: dict[str, Any], data: Mapping[str, Any]) -> dict:
        if all(existing[name] == data[name] for name in _IDENTITY_FIELDS):
            return existing
        raise ConflictError("idempotency key already belongs to a different action")

    async def _find_by_idempotency_key(self, key: str) -> dict[str, Any] | None:
        async with self._reader() as session:
            row = (
                await session.execute(select(ActionRow).where(ActionRow.idempotency_key == key))
            ).scalar_one_or_none()
            return row_to_dict(row) if row is not None else None

    async def _insert_action(self, data: Mapping[str, Any]) -> dict[str, Any]:
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
        async with self._transaction() as session:
            run = await self._lock_run(session, data["run_id"])
            if run.session_id != data["session_id"]:
                raise InvalidInputError("session_id does not match the run's session")
            now = await database_now(session)
            row = ActionRow(
                id=action_id,
                session_id=data["session_id"],
                run_id=data["run_id"],
                agent_id=data["agent_id"],
                tool_name=data["tool_name"],
                logical_action_id=data.get("logical_action_id"),
                turn_index=data.get("turn_index"),
                risk_level=data["risk_level"],
                status=data["status"],
                arguments=redact_arguments(arguments, data["safe_argument_fields"]),
                safe_argument_fields=data["safe_argument_fields"],
                arguments_digest=digest,
                result=(
                    {"error_code": DENIED_BY_POLICY}
                    if data["status"] == ActionStatus.REJECTED
                    else None
                ),
                finished_at=now if data["status"] == ActionStatus.REJECTED else None,
                attempt_count=0,
                target_key=data["target_key"],
                target_scope=data.get("target_scope"),
                target_namespace_wide=data["target_namespace_wide"],
                idempotency_key=data["idempotency_key"],
                created_at=now,
                updated_at=now,
            )
            session.add(row)
            if sealed is not None:
                session.add(
                    ActionSecretRow(action_id=action_id, arguments_encrypted=sealed, created_at=now)
                )
            await self._audit(
                session,
                run,
                "action.created",
                {
                    "action_id": action_id,
                    "agent_id": row.agent_id,
                    "tool_name": row.tool_name,
                    "risk_level": row.risk_level,
                    "status": row.status,
                    "logical_action_id": row.logical_action_id,
                    "turn_index": row.turn_index,
                },
                now,
            )
            if data.get("approval_expires_at") is not None:
                await self._add_approval(session, run, row, data["approval_expires_at"], now)
        return row_to_dict(row)

    async def _add_approval(
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
        await self._audit(
            session,
            run,
            "approval.requested",
            {
                "approval_id": approval.id,
                "action_id": action.id,
                "expires_at": expires_at.isoformat(),
            },
            now,
        )
        return approval

    async def get_action(self, action_id: str) -> dict[str, Any]:
        async with self._reader() as session:
            row = await session.get(ActionRow, action_id)
            if row is None:
                raise NotFoundError(f"action {action_id!r} not found")
            return row_to_dict(row)

    async def list_actions(self, run_id: str) -> list[dict[str, Any]]:
        async with self._reader() as session:
            if await session.get(RunRow, run_id) is None:
                raise NotFoundError(f"run {run_id!r} not found")
            rows = (
                await session.execute(
                    select(ActionRow)
                    .where(ActionRow.run_id == run_id)
                    .order_by(ActionRow.created_at, ActionRow.id)
                )
            ).scalars()
            return [row_to_dict(row) for row in rows]

    async def get_action_arguments(self, action_id: str) -> dict[str, Any]:
        """The full, decrypted arguments: for the executor only, never for display."""
        async with self._reader() as session:
            row = await session.get(ActionSecretRow, action_id)
            if row is None:
                raise NotFoundError(f"no stored arguments for action {action_id!r}")
            sealed = row.arguments_encrypted
        return decrypt_arguments(sealed, associated_data=action_id.encode())

    async def _lock_action(self, session: Any, action_id: str) -> tuple[RunRow, ActionRow]:
        """Lock the action's run, then read the action (stable while we hold it)."""
        run_id = (
            await session.execute(select(ActionRow.run_id).where(ActionRow.id == action_id))
        ).scalar_one_or_none()
        if run_id is None:
            raise NotFoundError(f"action {action_id!r} not found")
        run = await self._lock_run(session, run_id)
        action = (
            await session.execute(
                select(ActionRow)
                .where(ActionRow.id == action_id)
                .execution_options(populate_existing=True)
            )
        ).scalar_one()
        return run, action
