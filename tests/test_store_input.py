"""Bad input gets a clear, typed error and writes nothing."""

from __future__ import annotations

import pytest

from roundtable.security import ActionSecretKeyError
from roundtable.store import ConflictError, InvalidInputError, NotFoundError, open_store
from tests.helpers import new_action, new_run, target_for


async def test_action_fields_are_validated(store) -> None:
    run = await new_run(store)
    base = {"key": "v", "target_key": target_for()}
    for bad in (
        {"status": "executing"},
        {"status": "succeeded"},
        {"risk_level": "R9"},
        {"turn_index": "one"},
        # Past the 32-bit column: PostgreSQL refused it with a database error.
        {"turn_index": 2**40},
        {"arguments": ["not", "a", "dict"]},
        {"safe_argument_fields": "tenant_id"},
        {"surprise_field": 1},
    ):
        with pytest.raises(InvalidInputError):
            await new_action(store, run, **{**base, **bad})
    with pytest.raises(InvalidInputError):
        await store.create_action({"run_id": run["id"]})
    assert await store.list_actions(run["id"]) == []


async def test_idempotency_key_creates_one_action(store) -> None:
    run = await new_run(store)
    first = await new_action(store, run, key="same-call", target_key=target_for())
    again = await new_action(store, run, key="same-call", target_key=target_for())
    assert again["id"] == first["id"]
    with pytest.raises(ConflictError):
        await new_action(store, run, key="same-call", target_key=target_for("other"))
    assert len(await store.list_actions(run["id"])) == 1
    events = [e["event_type"] for e in await store.list_events(run["id"])]
    assert events.count("action.created") == 1


async def test_missing_secret_writes_nothing(store, monkeypatch) -> None:
    run = await new_run(store)
    target = target_for()
    monkeypatch.delenv("ROUNDTABLE_ACTION_SECRET_KEY")
    with pytest.raises(ActionSecretKeyError):
        await new_action(store, run, key="k", target_key=target, arguments={"a": 1})
    assert await store.list_actions(run["id"]) == []


async def test_runs_belong_to_their_session_owner(store) -> None:
    session = await store.create_session(user_id="alice", task_text="t")
    with pytest.raises(NotFoundError):
        await store.create_run(session_id=session["id"], user_id="mallory")
    with pytest.raises(NotFoundError):
        await store.create_run(session_id="missing", user_id="alice")
    with pytest.raises(InvalidInputError):
        await store.create_session(user_id="", task_text="t")
    run = await store.create_run(session_id=session["id"], user_id="alice")
    other_session = await store.create_session(user_id="alice", task_text="t2")
    with pytest.raises(InvalidInputError):
        await store.create_action(
            {
                "session_id": other_session["id"],
                "run_id": run["id"],
                "agent_id": "a",
                "tool_name": "t",
                "idempotency_key": "k",
                "target_key": "target:v1:x",
                "risk_level": "R1",
                "status": "approved",
            }
        )


async def test_lookups_of_missing_rows_raise_not_found(store) -> None:
    for call in (
        store.get_action,
        store.get_approval,
        store.get_run,
        store.get_session,
        store.get_action_arguments,
        store.list_actions,
    ):
        with pytest.raises(NotFoundError):
            await call("missing")


async def test_run_status_follows_its_state_machine(store) -> None:
    run = await new_run(store)
    assert (await store.set_run_status(run["id"], "running"))["status"] == "running"
    assert (await store.set_run_status(run["id"], "waiting_input"))["status"] == "waiting_input"
    assert (await store.get_session(run["session_id"]))["status"] == "waiting_input"
    assert (await store.set_run_status(run["id"], "running"))["status"] == "running"
    await store.set_run_status(run["id"], "completed")
    with pytest.raises(ConflictError):
        await store.set_run_status(run["id"], "running")
    with pytest.raises(InvalidInputError):
        await store.set_run_status(run["id"], "sleeping")


async def test_unsupported_database_url_is_a_clear_error() -> None:
    with pytest.raises(InvalidInputError, match="unsupported database URL"):
        async with open_store("mysql://localhost/x"):
            pass


async def test_sessions_and_runs_are_listed_by_owner_and_status(store) -> None:
    alice = await new_run(store, user_id="alice")
    bob = await new_run(store, user_id="bob")
    await store.set_run_status(bob["id"], "running")
    assert [r["id"] for r in await store.list_runs(user_id="alice")] == [alice["id"]]
    assert [r["id"] for r in await store.list_runs(status="running")] == [bob["id"]]
    assert len(await store.list_runs()) == 2
    assert [s["user_id"] for s in await store.list_sessions(user_id="bob")] == ["bob"]
    with pytest.raises(InvalidInputError):
        await store.list_runs(status="asleep")
