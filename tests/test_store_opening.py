"""A run opens in one transaction: its snapshot pinned and its status moved
to running together (Runs.pin_snapshot with ``status``), where it took a
transaction of its own and a local activity after. The status moves only
where set_status would have moved it, and a move the state machine refuses
leaves the run as it was for the status write that follows to refuse."""

from __future__ import annotations

import asyncio

import pytest

from roundtable.store import ConflictError, Store
from tests.helpers import new_run


async def _kinds(store: Store, run_id: str) -> list[str]:
    return [event["event_type"] for event in await store.list_events(run_id)]


async def test_the_pin_moves_a_new_run_to_running_in_the_same_transaction(store: Store) -> None:
    run = await new_run(store)
    assert run["status"] == "pending"
    assert await store.pin_snapshot(run["id"], "digest-1", status="running") == "running"
    stored = await store.get_run(run["id"])
    assert stored["status"] == "running" and stored["snapshot_digest"] == "digest-1"
    assert (await store.get_session(run["session_id"]))["status"] == "running"
    assert (await _kinds(store, run["id"]))[-2:] == ["run.snapshot_pinned", "run.status_changed"]


async def test_opening_again_changes_nothing(store: Store) -> None:
    """A reset or a retried local activity opens the run again."""
    run = await new_run(store)
    await store.pin_snapshot(run["id"], "digest-1", status="running")
    logged = await _kinds(store, run["id"])
    assert await store.pin_snapshot(run["id"], "digest-1", status="running") == "running"
    assert await _kinds(store, run["id"]) == logged


async def test_without_a_status_only_the_pin_is_written(store: Store) -> None:
    """Runs started before the opening carried the status."""
    run = await new_run(store)
    assert await store.pin_snapshot(run["id"], "digest-1") == "pending"
    assert (await store.get_run(run["id"]))["status"] == "pending"


async def test_a_run_that_ended_keeps_its_end_and_the_status_write_still_refuses(
    store: Store,
) -> None:
    run = await new_run(store)
    await store.set_run_status(run["id"], "completed")
    assert await store.pin_snapshot(run["id"], "digest-2", status="running") == "completed"
    assert (await store.get_run(run["id"]))["snapshot_digest"] == "digest-2"
    with pytest.raises(ConflictError):
        await store.set_run_status(run["id"], "running")


async def test_an_unknown_status_is_refused_before_anything_is_written(store: Store) -> None:
    run = await new_run(store)
    with pytest.raises(ValueError, match="unknown run status"):
        await store.pin_snapshot(run["id"], "digest-1", status="sprinting")
    assert (await store.get_run(run["id"]))["snapshot_digest"] is None


async def test_openers_racing_for_one_run_leave_one_run_one_session_and_a_sound_chain(
    store: Store,
) -> None:
    """Workers opening the same run at once (a reset, a retried local
    activity): the session and the run go in one transaction, so the losers
    leave no session behind, and every one of them gets the winner's run."""
    opened = await asyncio.gather(
        *(store.ensure_run(run_id="run-raced", user_id="racer", task_text="t") for _ in range(8))
    )
    assert len({run["session_id"] for run in opened}) == 1
    assert [s["id"] for s in await store.list_sessions(user_id="racer")] == [
        opened[0]["session_id"]
    ]
    assert await _kinds(store, "run-raced") == ["run.created"]
    await store.pin_snapshot("run-raced", "digest-1", status="running")
    await store.set_run_status("run-raced", "completed")
    assert await store.verify_audit_chain("run-raced")


async def test_the_opened_run_is_the_row_as_stored(store: Store) -> None:
    """What ensure_run and set_status answer is what a later read finds."""
    opened = await store.ensure_run(run_id="run-read-back", user_id="u", task_text="t")
    assert opened == await store.get_run("run-read-back")
    ended = await store.set_run_status(
        "run-read-back", "failed", failure={"code": "boom", "message": "it broke"}
    )
    assert ended == await store.get_run("run-read-back")
    assert ended["failure"] == {"code": "boom", "message": "it broke"}


async def test_a_run_named_by_a_number_keeps_a_sound_chain(store: Store) -> None:
    """Found in review: the Core status writes hashed their events with the
    id the caller gave; SQLite finds run "5" when asked for 5, so the events
    were hashed with a number and stored with text, and the chain no longer
    verified. PostgreSQL's driver refuses the number: nothing is written."""
    await store.ensure_run(run_id="5", user_id="u", task_text="t")
    for write in (
        lambda: store.pin_snapshot(5, "digest-1", status="running"),  # type: ignore[arg-type]
        lambda: store.set_run_status(5, "waiting_input"),  # type: ignore[arg-type]
    ):
        try:
            await write()
        except Exception:  # noqa: S110 - refused as a whole is fine; a broken chain is not
            pass
    assert await store.verify_audit_chain("5")
    with pytest.raises(Exception):  # noqa: B017 - any refusal, before anything is written
        await store.ensure_run(run_id=6, user_id="u", task_text="t")  # type: ignore[arg-type]


async def test_a_failure_is_answered_as_it_is_stored(store: Store) -> None:
    """Found in review: a failure message the database cannot keep as it is
    (NUL, a lone surrogate) was answered raw and stored escaped."""
    run = await new_run(store)
    failure = {"code": "tool\x00crash", "message": "it said a\x00b and \ud800"}
    answered = await store.set_run_status(run["id"], "failed", failure=failure)
    assert answered == await store.get_run(run["id"])
    assert answered["failure"]["message"] == "it said a\\u0000b and \\ud800"
    assert await store.verify_audit_chain(run["id"])
