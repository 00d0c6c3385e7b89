"""Operator commands: list and decide approvals, reconcile unknown actions, read tickets.

Decisions go through the run's workflow (the ``decide_approval`` and
``reconcile_action`` updates), so the CLI, the API and a plain
``temporal workflow update`` all meet one truth. The store is read first,
so an unknown id or a stale approval is answered clearly without a round trip.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import typer
from temporalio.client import WorkflowUpdateFailedError
from temporalio.service import RPCError, RPCStatusCode

from roundtable.cli.output import CliError, conflict, emit, fail, table
from roundtable.cli.shared import Actor, JsonFlag, actor, settings, store_from, temporal
from roundtable.models import DecisionInput, ReconcileInput
from roundtable.security import approval_to_public_dict
from roundtable.tools.tickets import TicketSystem

DECIDE, RECONCILE = "decide_approval", "reconcile_action"


def approvals(
    run: Annotated[str | None, typer.Option("--run", help="Only this run.")] = None,
    status: Annotated[
        str | None, typer.Option(help="pending, approved, rejected, expired.")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """List approvals with what each one would let run."""

    async def listing() -> list[dict[str, Any]]:
        async with store_from(settings()) as store:
            rows = await store.list_approvals(run_id=run, status=status)
            return [
                approval_to_public_dict(r, await store.get_action(r["action_id"])) for r in rows
            ]

    try:
        rows = asyncio.run(listing())
    except Exception as exc:
        fail(exc, as_json)
    emit(
        rows,
        as_json,
        table(rows, ["id", "run_id", "tool_name", "agent_id", "status", "expires_at", "arguments"]),
    )


async def _update(run_id: str, update: str, payload: Any) -> str:
    client = await temporal(settings())
    try:
        return await client.get_workflow_handle(run_id).execute_update(
            update, payload, result_type=str
        )
    except WorkflowUpdateFailedError as exc:
        raise conflict(str(exc.cause or exc)) from exc
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise conflict(
                f"run {run_id} has no live workflow to take this ({exc.message})"
            ) from exc
        raise CliError(f"Temporal refused the request: {exc.message}") from exc


async def _decide(approval_id: str, decision: str, by: str, reason: str | None) -> dict:
    async with store_from(settings()) as store:
        approval = await store.get_approval(approval_id)
    if approval["status"] != "pending":
        raise conflict(f"approval {approval_id} is already {approval['status']}")
    status = await _update(
        approval["run_id"],
        DECIDE,
        DecisionInput(approval_id=approval_id, decision=decision, decided_by=by, reason=reason),
    )
    return {
        "approval_id": approval_id,
        "run_id": approval["run_id"],
        "action_id": approval["action_id"],
        "status": status,
    }


def approve(
    approval_id: Annotated[str, typer.Argument(help="Approval id.")],
    reason: Annotated[str | None, typer.Option(help="Why.")] = None,
    by: Actor = None,
    as_json: JsonFlag = False,
) -> None:
    """Approve a pending write."""
    _decide_command(approval_id, "approved", by, reason, as_json)


def reject(
    approval_id: Annotated[str, typer.Argument(help="Approval id.")],
    reason: Annotated[str, typer.Option(help="Why (required).")],
    by: Actor = None,
    as_json: JsonFlag = False,
) -> None:
    """Reject a pending write."""
    _decide_command(approval_id, "rejected", by, reason, as_json)


def _decide_command(
    approval_id: str, decision: str, by: str | None, reason: str | None, as_json: bool
) -> None:
    try:
        done = asyncio.run(_decide(approval_id, decision, actor(by), reason))
    except Exception as exc:
        fail(exc, as_json)
    emit(done, as_json, f"approval {approval_id} {done['status']}")


def reconcile(
    action_id: Annotated[str, typer.Argument(help="Action id (status unknown).")],
    outcome: Annotated[str, typer.Option(help="succeeded or failed: what really happened.")],
    note: Annotated[str, typer.Option(help="How you know (kept in the audit log).")],
    by: Actor = None,
    as_json: JsonFlag = False,
) -> None:
    """Settle an action whose outcome is unknown, after checking the real system."""

    async def settle() -> dict:
        if outcome not in ("succeeded", "failed"):
            raise CliError("--outcome must be succeeded or failed", "usage", 2)
        async with store_from(settings()) as store:
            action = await store.get_action(action_id)
        if action["status"] != "unknown":
            raise conflict(f"action {action_id} is {action['status']}, not unknown")
        status = await _update(
            action["run_id"],
            RECONCILE,
            ReconcileInput(action_id=action_id, outcome=outcome, decided_by=actor(by), note=note),
        )
        return {"action_id": action_id, "run_id": action["run_id"], "status": status}

    try:
        done = asyncio.run(settle())
    except Exception as exc:
        fail(exc, as_json)
    emit(done, as_json, f"action {action_id} reconciled as {done['status']}")


def tickets(as_json: JsonFlag = False) -> None:
    """The demo ticket system's write log: what really happened."""

    async def read() -> list[dict[str, Any]]:
        system = await TicketSystem.open(settings().database_url)
        try:
            return await system.write_log()
        finally:
            await system.close()

    try:
        rows = asyncio.run(read())
    except Exception as exc:
        fail(exc, as_json)
    emit(
        rows,
        as_json,
        table(
            rows,
            [
                "tenant_id",
                "ticket_id",
                "operation",
                "fencing_token",
                "outcome",
                "started_at",
                "finished_at",
            ],
        ),
    )
