"""A worker frozen past its lease cannot land its write after an operator
reconciled it as failed: reconciling fences the tool first.

Found by the chaos harness (and by the Spin model): a worker was SIGSTOPped
mid-write; its lease ran out, the action became unknown, the operator saw the
ticket write still "started" and reconciled "failed"; then the worker woke
and the write applied. No newer writer had reached that ticket, so the
fencing token had nothing to compare against."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from temporalio.testing import ActivityEnvironment

from activities.write_activities import WriteActivities
from roundtable.models import ReconcileInput
from roundtable.security import derive_target
from roundtable.store import open_store
from roundtable.tools.registry import ToolContext, ToolDefiniteFailure, ToolRegistry
from roundtable.tools.tickets import TicketSystem, TicketUpdateArgs, register_ticket_tools
from tests.workflow_harness import TRUSTING, as_operator


async def test_a_failed_reconciliation_fences_a_frozen_attempt(tmp_path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'rt.db'}"
    async with open_store(url) as store:
        tickets = await TicketSystem.open(url)
        try:
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
                    "idempotency_key": "k-frozen",
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
                idempotency_key="k-frozen",
                fencing_token=token,
            )
            parsed = TicketUpdateArgs.model_validate(arguments)
            # The worker starts its write, then freezes (nothing more from it).
            await tickets._start("update", parsed, ctx)
            later = datetime.now(UTC) + timedelta(seconds=5)
            await store.recover_expired_action_leases(now=later)
            assert (await store.get_action(action["id"]))["status"] == "unknown"

            writes = WriteActivities(store, registry, authority=TRUSTING)
            reconcile = as_operator(
                ReconcileInput(
                    action_id=action["id"],
                    outcome="failed",
                    decided_by="ops",
                    note="the ticket shows the write started, never finished",
                )
            )
            await asyncio.sleep(2.2)  # until the lease has run out by the database's clock
            out = await ActivityEnvironment().run(writes.reconcile_action, reconcile)
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
