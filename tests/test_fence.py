"""A worker frozen past its lease cannot land its write after an operator
reconciled it as failed: reconciling fences the tool first.

Found by the chaos harness (and by the Spin model): a worker was SIGSTOPped
mid-write; its lease ran out, the action became unknown, the operator saw the
ticket write still "started" and reconciled "failed"; then the worker woke
and the write applied. No newer writer had reached that ticket, so the
fencing token had nothing to compare against."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from temporalio.testing import ActivityEnvironment

from activities.write_activities import WriteActivities
from roundtable.models import ReconcileInput
from roundtable.security import derive_target
from roundtable.store import open_store
from roundtable.tools import tickets as tickets_module
from roundtable.tools.registry import ToolContext, ToolDefiniteFailure, ToolRegistry
from roundtable.tools.tickets import TicketSystem, TicketUpdateArgs, register_ticket_tools
from tests.workflow_harness import TRUSTING, as_operator


async def test_a_failed_reconciliation_fences_a_frozen_attempt(tmp_path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'rt.db'}"
    async with open_store(url) as store:
        tickets = await TicketSystem.open(url)
        try:
            registry, action, token, ctx, parsed = await claimed_write(store, tickets)
            # The worker starts its write, then freezes (nothing more from it).
            await tickets._start("update", parsed, ctx, [])
            later = datetime.now(UTC) + timedelta(seconds=5)
            await store.recover_expired_action_leases(now=later)
            assert (await store.get_action(action["id"]))["status"] == "unknown"

            await asyncio.sleep(2.2)  # until the lease has run out by the database's clock
            writes = WriteActivities(store, registry, authority=TRUSTING)
            out = await ActivityEnvironment().run(
                writes.reconcile_action, failed_by_operator(action["id"])
            )
            assert out.status == "failed", out
            assert (await store.get_action(action["id"]))["result"]["fenced_below"] == token + 1

            # The worker wakes and finishes its write: the ticket refuses it.
            try:
                await tickets._finish(parsed, ctx, lambda t: t.fields.update(p="1"))
                raise AssertionError("a fenced write applied")
            except ToolDefiniteFailure as refused:
                assert refused.code == "stale_fencing_token"
            (write,) = await tickets.write_log()
            assert write["outcome"] == "rejected_stale"
            assert (await tickets.get(parsed, ctx))["fields"] == {}
        finally:
            await tickets.close()


@pytest.mark.parametrize("frozen_in", ["start", "finish"])
async def test_a_write_frozen_inside_its_transaction_and_the_fence_never_both_win(
    database_url: str, tmp_path, monkeypatch, frozen_in: str
) -> None:
    """Found in review: frozen after reading the ticket inside its write's
    transaction, a worker's write still applied after the fence on PostgreSQL
    (no row lock), or erased the fence; and a write that woke during the
    reconciliation applied while the store recorded "failed". Now the ticket
    row is locked, and the fence reports a write it finds applied."""
    on_sqlite = database_url.startswith("sqlite")
    tickets_url = f"sqlite+aiosqlite:///{tmp_path / 'tickets.db'}" if on_sqlite else database_url
    async with open_store(database_url) as store:
        tickets = await TicketSystem.open(tickets_url)
        try:
            registry, action, _, ctx, parsed = await claimed_write(store, tickets)
            if frozen_in == "finish":
                await tickets._start("update", parsed, ctx, [])
            else:
                await tickets.fence(parsed, ToolContext(run_id="x", seat="s", fencing_token=0))
            frozen, wake = asyncio.Event(), asyncio.Event()
            reads_ticket = tickets_module._locked_ticket

            async def freezing(conn, args):  # type: ignore[no-untyped-def]
                row = await reads_ticket(conn, args)
                if not frozen.is_set():
                    frozen.set()
                    await wake.wait()  # SIGSTOP, between the read and the commit
                return row

            monkeypatch.setattr(tickets_module, "_locked_ticket", freezing)

            async def worker() -> Any:
                try:
                    if frozen_in == "start":
                        await tickets._start("update", parsed, ctx, [])
                    return await tickets._finish(parsed, ctx, lambda t: t.fields.update(p="1"))
                except ToolDefiniteFailure as refused:
                    return refused

            writing = asyncio.create_task(worker())
            await frozen.wait()
            await store.recover_expired_action_leases(now=datetime.now(UTC) + timedelta(seconds=5))
            await asyncio.sleep(2.2)  # the lease has run out by the database's clock

            async def wakes_soon() -> None:
                await asyncio.sleep(0.5)
                wake.set()

            waking = asyncio.create_task(wakes_soon())
            writes = WriteActivities(store, registry, authority=TRUSTING)
            out = await ActivityEnvironment().run(
                writes.reconcile_action, failed_by_operator(action["id"])
            )
            await waking
            await writing
            (write,) = await tickets.write_log()
            settled = await store.get_action(action["id"])
            # Never both: "failed" in the store and the write applied.
            assert not (settled["status"] == "failed" and write["outcome"] == "applied")
            if write["outcome"] == "applied":
                assert out.conflict and "applied" in out.conflict, out
                assert settled["status"] == "unknown"
            else:
                assert settled["status"] == "failed" and write["outcome"] == "rejected_stale"
        finally:
            await tickets.close()


async def claimed_write(store: Any, tickets: TicketSystem) -> tuple:  # type: ignore[type-arg]
    registry = ToolRegistry()
    register_ticket_tools(registry, tickets)
    snapshot = registry.snapshot(["seat-1"]).model_dump()
    arguments = {"tenant_id": "acme", "ticket_id": "T-1", "fields": {"p": "1"}}
    target = derive_target("ticket_update", arguments, snapshot, "seat-1")
    session = await store.create_session(user_id="u", task_text="t")
    run = await store.create_run(session_id=session["id"], user_id="u")
    action = await store.create_action(
        {
            "session_id": run["session_id"],
            "run_id": run["id"],
            "agent_id": "seat-1",
            "tool_name": "ticket_update",
            "idempotency_key": f"{run['id']}-frozen",
            "target_key": target.key,
            "target_scope": target.scope,
            "risk_level": "R2",
            "status": "approved",
            "arguments": arguments,
            "safe_argument_fields": ["tenant_id", "ticket_id"],
        }
    )
    assert await store.claim_action_for_execution(action["id"], 2) == "claimed"
    token = (await store.get_action(action["id"]))["fencing_token"]
    ctx = ToolContext(
        run_id=run["id"],
        seat="seat-1",
        action_id=action["id"],
        idempotency_key=f"{run['id']}-frozen",
        fencing_token=token,
    )
    return registry, action, token, ctx, TicketUpdateArgs.model_validate(arguments)


def failed_by_operator(action_id: str) -> ReconcileInput:
    return as_operator(
        ReconcileInput(
            action_id=action_id,
            outcome="failed",
            decided_by="ops",
            note="the ticket shows the write started, never finished",
            request_id=uuid.uuid4().hex,
        )
    )
