"""Operator commands: list and decide approvals, reconcile unknown actions, read tickets.

Decisions go through the run's workflow (the ``decide_approval`` and
``reconcile_action`` updates), directly or through the API, so the CLI, the
API and a plain ``temporal workflow update`` all meet one truth. The
approval or action is read first, so an unknown id or a stale approval is
answered clearly without a round trip to the workflow.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from roundtable.cli.endpoint import ApiToken, ApiTokenFile, ApiUrl, named
from roundtable.cli.operator import ask, operator
from roundtable.cli.output import emit, run_or_fail, table, usage_error
from roundtable.cli.shared import Actor, JsonFlag, require_sqlite_file, settings
from roundtable.tools.tickets import TicketSystem


def approvals(
    run: Annotated[str | None, typer.Option("--run", help="Only this run.")] = None,
    status: Annotated[
        str | None, typer.Option(help="pending, approved, rejected, expired or withdrawn.")
    ] = None,
    api: ApiUrl = None,
    token: ApiToken = None,
    token_file: ApiTokenFile = None,
    as_json: JsonFlag = False,
) -> None:
    """List approvals with what each one would let run."""

    rows = ask((api, token, token_file), lambda ops: ops.approvals(run, status), as_json)
    emit(
        rows,
        as_json,
        table(rows, ["id", "run_id", "tool_name", "agent_id", "status", "expires_at", "arguments"]),
    )


def approve(
    approval_id: Annotated[str, typer.Argument(help="Approval id.")],
    reason: Annotated[str | None, typer.Option(help="Why.")] = None,
    by: Actor = None,
    api: ApiUrl = None,
    token: ApiToken = None,
    token_file: ApiTokenFile = None,
    as_json: JsonFlag = False,
) -> None:
    """Approve a pending write."""
    _decide(approval_id, "approved", reason, by, (api, token, token_file), as_json)


def reject(
    approval_id: Annotated[str, typer.Argument(help="Approval id.")],
    reason: Annotated[str, typer.Option(help="Why (required).")],
    by: Actor = None,
    api: ApiUrl = None,
    token: ApiToken = None,
    token_file: ApiTokenFile = None,
    as_json: JsonFlag = False,
) -> None:
    """Reject a pending write."""
    _decide(approval_id, "rejected", reason, by, (api, token, token_file), as_json)


def _decide(
    approval_id: str,
    decision: str,
    reason: str | None,
    by: str | None,
    via: tuple[Any, Any, Any],
    as_json: bool,
) -> None:
    async def decide() -> dict[str, Any]:
        async with operator(*via) as ops:
            return await ops.decide(approval_id, decision, reason, by)

    done = run_or_fail(decide(), as_json)
    emit(done, as_json, f"approval {approval_id} {done['status']}")


def reconcile(
    action_id: Annotated[str, typer.Argument(help="Action id (status unknown).")],
    outcome: Annotated[str, typer.Option(help="succeeded or failed: what really happened.")],
    note: Annotated[str, typer.Option(help="How you know (kept in the audit log).")],
    by: Actor = None,
    api: ApiUrl = None,
    token: ApiToken = None,
    token_file: ApiTokenFile = None,
    as_json: JsonFlag = False,
) -> None:
    """Settle an action whose outcome is unknown, after checking the real system."""

    async def settle() -> dict[str, Any]:
        if outcome not in ("succeeded", "failed"):
            raise usage_error("--outcome must be succeeded or failed")
        async with operator(api, token, token_file) as ops:
            return await ops.reconcile(action_id, outcome, note, by)

    done = run_or_fail(settle(), as_json)
    emit(done, as_json, f"action {action_id} reconciled as {done['status']}")


def recover(
    run_id: Annotated[str, typer.Argument(help="Run id (stalled: its history does not replay).")],
    note: Annotated[str, typer.Option(help="Why (kept in the audit log).")],
    by: Actor = None,
    api: ApiUrl = None,
    token: ApiToken = None,
    token_file: ApiTokenFile = None,
    as_json: JsonFlag = False,
) -> None:
    """Reset a stalled run to the first workflow task a replay fails at.

    For a run whose workflow tasks fail because its history holds commands
    this code does not make (`roundtable show` says stalled, with the
    nondeterminism). Writes already run stay run, turns already taken are not
    asked again; a run not stalled so is refused."""
    done = ask((api, token, token_file), lambda ops: ops.recover(run_id, note, by), as_json)
    emit(
        done,
        as_json,
        f"run {run_id} reset to event {done['reset_to_event']}: "
        f"execution {done['from_execution']} → {done['execution']}",
    )


def tickets(
    api: ApiUrl = None,
    token: ApiToken = None,
    token_file: ApiTokenFile = None,
    as_json: JsonFlag = False,
) -> None:
    """The demo ticket system's write log: what really happened."""

    async def read() -> list[dict[str, Any]]:
        if named(api):
            # Never quietly read a database when the operator asked for the API.
            raise usage_error(
                "the API does not serve the demo ticket log: run `roundtable tickets` where "
                "its database is, without --api or $ROUNDTABLE_API_URL"
            )
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
