"""Operator commands: list and decide approvals, reconcile unknown actions, read tickets.

Decisions go through the run's workflow (the ``decide_approval`` and
``reconcile_action`` updates), so the CLI, the API and a plain
``temporal workflow update`` all meet one truth. The store is read first,
so an unknown id or a stale approval is answered clearly without a round trip.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from roundtable import operations
from roundtable.cli.output import emit, run_or_fail, table, usage_error
from roundtable.cli.shared import (
    Actor,
    JsonFlag,
    actor,
    require_sqlite_file,
    settings,
    store_from,
    temporal,
)
from roundtable.permissions import Decider
from roundtable.tools.tickets import TicketSystem
from roundtable.views import approval_view


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
            return [await approval_view(store, row) for row in rows]

    rows = run_or_fail(listing(), as_json)
    emit(
        rows,
        as_json,
        table(rows, ["id", "run_id", "tool_name", "agent_id", "status", "expires_at", "arguments"]),
    )


async def _decide(approval_id: str, decision: str, by: str, reason: str | None) -> dict:
    config = settings()
    client = await temporal(config)
    async with store_from(config) as store:
        # The CLI acts with database access, as an operator would.
        return await operations.decide(
            client,
            store,
            approval_id,
            decision,
            by,
            reason,
            decider=Decider(user_id=by, role="operator"),
        )


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
    done = run_or_fail(_decide(approval_id, decision, actor(by), reason), as_json)
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
            raise usage_error("--outcome must be succeeded or failed")
        config = settings()
        async with store_from(config) as store:
            # operations.reconcile checks the action (and nudges its run if it
            # was settled already), as it does for the API and the client.
            client = await temporal(config)
            return await operations.reconcile(
                client, store, action_id, outcome, actor(by), note, config.task_queue
            )

    done = run_or_fail(settle(), as_json)
    emit(done, as_json, f"action {action_id} reconciled as {done['status']}")


def tickets(as_json: JsonFlag = False) -> None:
    """The demo ticket system's write log: what really happened."""

    async def read() -> list[dict[str, Any]]:
        require_sqlite_file(settings().tickets_url())
        system = await TicketSystem.open(settings().tickets_url())
        try:
            return await system.write_log()
        finally:
            await system.close()

    rows = run_or_fail(read(), as_json)
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
