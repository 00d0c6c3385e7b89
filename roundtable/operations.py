"""Operator actions every interface shares (CLI, HTTP API, typed client).

Decisions and reconciliations go through the run's workflow updates, so all
interfaces and a plain ``temporal workflow update`` meet one truth; Temporal's
refusals come back as the store's typed errors.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from roundtable.models import (
    DecisionInput,
    ExtendInput,
    ExtendOutput,
    ReconcileInput,
    RunInput,
    WorkflowArgs,
)
from roundtable.store import ConflictError, InvalidInputError, Store
from roundtable.temporal import WORKFLOW_NAME

DECIDE_UPDATE, RECONCILE_UPDATE = "decide_approval", "reconcile_action"
EXTEND_UPDATE = "extend_approval"
FINGERPRINT_MEMO = "request_fingerprint"


class TemporalUnavailableError(RuntimeError):
    code = "temporal_unavailable"


def _typed(exc: WorkflowUpdateFailedError) -> Exception:
    """Bad input stays bad input (422); every other refusal is a conflict (409)."""
    cause = exc.cause
    while cause is not None and not isinstance(cause, ApplicationError):
        cause = cause.cause
    message = str(cause or exc)
    if isinstance(cause, ApplicationError) and cause.type == "InvalidInput":
        return InvalidInputError(message)
    return ConflictError(message)


async def send_update(client: Client, run_id: str, update: str, payload: Any) -> str:
    try:
        return await client.get_workflow_handle(run_id).execute_update(
            update, payload, result_type=str
        )
    except WorkflowUpdateFailedError as exc:
        raise _typed(exc) from exc
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise ConflictError(f"run {run_id} has no live workflow ({exc.message})") from exc
        if exc.status == RPCStatusCode.UNAVAILABLE:
            raise TemporalUnavailableError(f"Temporal is unavailable: {exc.message}") from exc
        raise


async def decide(
    client: Client,
    store: Store,
    approval_id: str,
    decision: str,
    decided_by: str,
    reason: str | None = None,
    arguments_digest: str | None = None,
    arguments: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Decide a pending approval, optionally approving edited ``arguments``.
    NotFoundError / ConflictError / InvalidInputError as the store raises them."""
    approval = await store.get_approval(approval_id)
    if approval["status"] != "pending":
        raise ConflictError(f"approval {approval_id} is already {approval['status']}")
    if arguments_digest is not None:
        action = await store.get_action(approval["action_id"])
        if action["arguments_digest"] != arguments_digest:
            raise ConflictError("arguments_digest does not match the arguments awaiting approval")
    status = await send_update(
        client,
        approval["run_id"],
        DECIDE_UPDATE,
        DecisionInput(
            approval_id=approval_id,
            decision=decision,
            decided_by=decided_by,
            reason=reason,
            arguments_digest=arguments_digest,
            arguments=arguments,
        ),
    )
    return {
        "approval_id": approval_id,
        "run_id": approval["run_id"],
        "action_id": approval["action_id"],
        "status": status,
    }


async def extend(
    client: Client, store: Store, approval_id: str, seconds: int, by: str, max_seconds: int
) -> dict[str, Any]:
    """Push a pending approval's deadline back through its workflow (the timer follows)."""
    approval = await store.get_approval(approval_id)
    if approval["status"] != "pending":
        raise ConflictError(f"approval {approval_id} is already {approval['status']}")
    if seconds > max_seconds:
        raise InvalidInputError(f"an extension is at most {max_seconds} seconds")
    try:
        extended = await client.get_workflow_handle(approval["run_id"]).execute_update(
            EXTEND_UPDATE,
            ExtendInput(
                approval_id=approval_id, seconds=seconds, extended_by=by, max_seconds=max_seconds
            ),
            result_type=ExtendOutput,
        )
    except WorkflowUpdateFailedError as exc:
        raise _typed(exc) from exc
    return {
        "approval_id": approval_id,
        "run_id": approval["run_id"],
        "expires_at": extended.expires_at.isoformat(),
    }


async def reconcile(
    client: Client, store: Store, action_id: str, outcome: str, decided_by: str, note: str | None
) -> dict[str, Any]:
    action = await store.get_action(action_id)
    if action["status"] != "unknown":
        raise ConflictError(f"action {action_id} is {action['status']}, not unknown")
    status = await send_update(
        client,
        action["run_id"],
        RECONCILE_UPDATE,
        ReconcileInput(action_id=action_id, outcome=outcome, decided_by=decided_by, note=note),
    )
    return {"action_id": action_id, "run_id": action["run_id"], "status": status}


def new_run_id() -> str:
    return f"run-{uuid.uuid4().hex[:16]}"


def request_fingerprint(request: RunInput) -> str:
    body = json.dumps(request.model_dump(mode="json", exclude={"run_id"}), sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


def idempotent_run_id(user_id: str, idempotency_key: str) -> str:
    return "run-" + hashlib.sha256(f"{user_id}\n{idempotency_key}".encode()).hexdigest()[:24]


async def start_run(
    client: Client, store: Store, request: RunInput, task_queue: str
) -> tuple[dict[str, Any], bool]:
    """Create the run's rows, then its workflow. Returns ``(run, created)``;
    an existing workflow with this id is reused if it was asked the same."""
    run_id = request.run_id or new_run_id()
    request = request.model_copy(update={"run_id": run_id})
    fingerprint = request_fingerprint(request)
    await store.ensure_run(run_id=run_id, user_id=request.user_id, task_text=request.task_text)
    try:
        await client.start_workflow(
            WORKFLOW_NAME,
            WorkflowArgs(request=request),
            id=run_id,
            task_queue=task_queue,
            memo={FINGERPRINT_MEMO: fingerprint},
            static_summary=f"Roundtable: {request.task_text[:100]}",
            static_details=(
                f"seats {', '.join(request.seats)} · {request.max_rounds} round(s) · "
                f"{request.mode} · policy {request.write_policy} · user {request.user_id}"
            ),
        )
        created = True
    except WorkflowAlreadyStartedError:
        described = await client.get_workflow_handle(run_id).describe()
        if await described.memo_value(FINGERPRINT_MEMO, None, type_hint=str) != fingerprint:
            raise ConflictError(
                "this Idempotency-Key was already used for a different request"
            ) from None
        created = False
    except RPCError as exc:
        if exc.status == RPCStatusCode.UNAVAILABLE:
            raise TemporalUnavailableError(f"Temporal is unavailable: {exc.message}") from exc
        raise
    run = await store.get_run(run_id)
    return {"run_id": run_id, "workflow_id": run_id, "status": run["status"]}, created
