"""The store's hot paths send statements built once, on both databases.

A fast connection keeps each statement's compiled form by the statement
object (roundtable/store/core_statements.py), so a statement built per call
is compiled afresh every time, its cache key generated again, and kept in a
bounded cache that then holds the dead statement (in the worker's memory, as
bench/README measures for a waiting run) and lets a live one go. Here a whole
write's life on the paths a run takes (its run and session, the action with
its approval and its secret, the decision, the claim, the lease's hold, the
outcome) runs a few times over: after the first, nothing new may enter the
cache."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from roundtable.store import Store, core_statements
from tests.helpers import WRITE_TOOL, target_for


async def _one_write(store: Store, key: str) -> None:
    run = await store.ensure_run(run_id=f"run-{key}", user_id="u1", task_text="task")
    action = await store.create_action(
        {
            "session_id": run["session_id"],
            "run_id": run["id"],
            "agent_id": "seat-1",
            "tool_name": WRITE_TOOL,
            "idempotency_key": key,
            "target_key": target_for(key),
            "risk_level": "R3",
            "status": "waiting_approval",
            "arguments": {"tenant_id": "tenant-a", "object_id": key},
            "approval_expires_at": datetime.now(UTC) + timedelta(minutes=5),
        }
    )
    await store.decide_approval(action["approval_id"], "approved", "op-1", None)
    claim = await store.claim_for_execution(action["id"], 30)
    assert claim.outcome == "claimed" and claim.action is not None
    token = claim.action["fencing_token"]
    assert await store.hold_action_lease(action["id"], token, 30) == "executing"
    recorded = await store.record_action_terminal_result(
        action["id"], "succeeded", {"ok": True}, fencing_token=token, attempt_over=True
    )
    assert recorded is True
    assert (await store.get_action(action["id"]))["status"] == "succeeded"


def _kept() -> set[Any]:
    return set(core_statements._COMPILED)


async def test_a_write_s_life_adds_nothing_to_the_compiled_cache(store: Store) -> None:
    await _one_write(store, "first")  # builds and compiles what the paths use
    before = _kept()
    for n in range(3):
        await _one_write(store, f"again-{n}")
    added = [entry[1] for key, entry in core_statements._COMPILED.items() if key not in before]
    assert added == [], [str(statement).split("\n")[0] for statement in added]
