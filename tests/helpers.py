"""Small builders shared by the store tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import event

from roundtable.security import derive_target_key
from roundtable.store import Store

WRITE_TOOL = "controlled_write"


def snapshot(*agents: str) -> dict[str, Any]:
    tool = {
        "name": WRITE_TOOL,
        "side_effect": "write",
        "risk_level": "R3",
        "target_key_fields": ["tenant_id", "object_id"],
        "target_key_namespace": "lease-test",
    }
    return {
        "tools": [tool],
        "agents": [{"agent_id": agent, "tools": [tool]} for agent in (agents or ("seat-1",))],
    }


def target_for(object_id: str = "task-7", tenant_id: str = "tenant-a") -> str:
    return derive_target_key(
        WRITE_TOOL, {"tenant_id": tenant_id, "object_id": object_id}, snapshot(), "seat-1"
    )


async def new_run(store: Store, user_id: str = "u1") -> dict[str, Any]:
    session = await store.create_session(user_id=user_id, task_text="test task")
    return await store.create_run(session_id=session["id"], user_id=user_id)


async def new_action(
    store: Store,
    run: dict[str, Any],
    *,
    key: str,
    target_key: str,
    status: str = "approved",
    agent_id: str = "seat-1",
    **extra: Any,
) -> dict[str, Any]:
    return await store.create_action(
        {
            "session_id": run["session_id"],
            "run_id": run["id"],
            "agent_id": agent_id,
            "tool_name": WRITE_TOOL,
            "idempotency_key": key,
            "target_key": target_key,
            "risk_level": "R3",
            "status": status,
            **extra,
        }
    )


async def waiting_action(
    store: Store, run: dict[str, Any], key: str, expires_at: datetime
) -> dict[str, Any]:
    """An action of ``run`` waiting for a person until ``expires_at``, on a
    target of its own (named by ``key``)."""
    return await new_action(
        store,
        run,
        key=key,
        target_key=target_for(key),
        status="waiting_approval",
        approval_expires_at=expires_at,
    )


async def set_column(store: Store, model: Any, where: Any, **values: Any) -> None:
    """Test-only surgery, e.g. to move a deadline into the past."""
    from sqlalchemy import update

    async with store.session_factory() as session, session.begin():
        await session.execute(update(model).where(where).values(**values))


def target_fields(object_id: object = "task-7", namespace: str = "lease-test") -> dict[str, Any]:
    """create_action fields for a target, scope included (as the intercept will pass them)."""
    from roundtable.security import derive_target

    snap = snapshot()
    snap["tools"][0]["target_key_namespace"] = namespace
    target = derive_target(
        WRITE_TOOL, {"tenant_id": "tenant-a", "object_id": object_id}, snap, "seat-1"
    )
    return {
        "target_key": target.key,
        "target_scope": target.scope,
        "target_namespace_wide": target.namespace_wide,
    }


class FailOnce:
    """A hook (an engine event listener, say) that raises ``error`` the first
    time it is called and lets everything through after; ``armed`` until then."""

    def __init__(self, error: BaseException) -> None:
        self.error, self.armed = error, True

    def __call__(self, *_: Any) -> None:
        if self.armed:
            self.armed = False
            raise self.error


async def claim_until_done(store: Store, ids: list[str], rounds: int = 400) -> dict[str, Any]:
    """Claim each write in ``ids`` until it is claimed (and then finished) or
    found claimed by someone else, looping over them; how many claims had
    each outcome, and the errors raised (under ``"errors"``)."""
    seen: dict[str, Any] = {}
    pending = list(ids)
    for _ in range(rounds):
        if not pending:
            break
        for action_id in list(pending):
            try:
                outcome = await store.claim_action_for_execution(action_id, 60)
            except Exception as exc:
                seen.setdefault("errors", []).append(repr(exc))
                continue
            seen[outcome] = seen.get(outcome, 0) + 1
            if outcome == "claimed":
                await store.record_action_terminal_result(action_id, "succeeded", {})
            if outcome in ("claimed", "already_finished", "in_progress"):
                pending.remove(action_id)
        await asyncio.sleep(0.001)
    return seen


@contextmanager
def listening(engine: Any, name: str, listener: Callable[..., Any]) -> Iterator[None]:
    """``listener`` hears the engine's ``name`` events while the block runs."""
    event.listen(engine.sync_engine, name, listener)
    try:
        yield
    finally:
        event.remove(engine.sync_engine, name, listener)


async def two_writes_on_one_target(
    store: Store, name: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A run with two approved writes on one target (``name``): the run, the
    first, the second."""
    run = await new_run(store)
    target = target_fields(name)
    first = await new_action(store, run, key=f"{name}-1", **target)
    second = await new_action(store, run, key=f"{name}-2", **target)
    return run, first, second
