"""The audit log: complete, hash-chained, append-only, free of secrets."""

from __future__ import annotations

import pytest
from sqlalchemy import delete, text, update
from sqlalchemy.exc import DBAPIError

from roundtable.store.schema import AuditEventRow
from tests.helpers import new_action, new_run, target_for

CANARY = "sk-live-CANARY-7f3a"


async def test_every_transition_is_audited_in_order(store) -> None:
    run = await new_run(store)
    action = await new_action(store, run, key="k", target_key=target_for())
    assert await store.claim_action_for_execution(action["id"], 30) == "claimed"
    assert await store.record_action_terminal_result(
        action["id"], "unknown", {"error_code": "x"}, attempt_over=True
    )
    await store.reconcile_action(action["id"], "failed", "op-1", "never arrived")
    await store.set_run_status(run["id"], "running")

    events = await store.list_events(run["id"])
    assert [e["event_type"] for e in events] == [
        "run.created",
        "action.created",
        "action.executing",
        "action.unknown",
        "action.reconciled",
        "run.status_changed",
    ]
    assert [e["seq"] for e in events] == list(range(1, 7))
    assert await store.verify_audit_chain(run["id"])


async def test_audit_log_is_append_only_at_the_database(store) -> None:
    run = await new_run(store)
    for statement in (
        update(AuditEventRow).where(AuditEventRow.run_id == run["id"]).values(event_type="x"),
        delete(AuditEventRow).where(AuditEventRow.run_id == run["id"]),
    ):
        with pytest.raises(DBAPIError, match="append-only"):
            async with store.session_factory() as session, session.begin():
                await session.execute(statement)
    assert len(await store.list_events(run["id"])) == 1


async def test_tampering_breaks_the_chain(store) -> None:
    run = await new_run(store)
    await new_action(store, run, key="k", target_key=target_for())
    assert await store.verify_audit_chain(run["id"])
    # Simulate an attacker with table-owner rights who disables the trigger.
    async with store.session_factory() as session, session.begin():
        if store.engine.dialect.name == "postgresql":
            await session.execute(text("ALTER TABLE audit_events DISABLE TRIGGER USER"))
        else:
            await session.execute(text("DROP TRIGGER audit_events_no_update"))
        await session.execute(
            update(AuditEventRow)
            .where(AuditEventRow.run_id == run["id"], AuditEventRow.seq == 2)
            .values(payload={"action_id": "someone-else"})
        )
    assert not await store.verify_audit_chain(run["id"])


async def test_secrets_never_reach_rows_events_or_views(store) -> None:
    """Full arguments exist only as ciphertext; everything else shows [redacted]."""
    from roundtable.security import action_to_public_dict

    run = await new_run(store)
    action = await new_action(
        store,
        run,
        key="secret",
        target_key=target_for(),
        arguments={"tenant_id": "tenant-a", "api_key": CANARY},
        safe_argument_fields=["tenant_id"],
    )
    assert action["arguments"] == {"tenant_id": "tenant-a", "api_key": "[redacted]"}
    assert await store.get_action_arguments(action["id"]) == {
        "tenant_id": "tenant-a",
        "api_key": CANARY,
    }
    assert CANARY not in repr(action_to_public_dict(await store.get_action(action["id"])))
    assert CANARY not in repr(await store.list_events(run["id"]))

    # Look at every text column of every table, as stored.
    tables = [
        "sessions",
        "runs",
        "actions",
        "action_secrets",
        "approvals",
        "action_leases",
        "audit_events",
    ]
    async with store.session_factory() as session:
        for table in tables:
            rows = (await session.execute(text(f"SELECT * FROM {table}"))).all()  # noqa: S608
            assert CANARY not in repr(rows), table
