"""A caller cancelled mid-call never leaves the database stuck.

Found while hardening the lease keeper: cancelling a store call in the middle
of its transaction could leave an aiosqlite connection holding SQLite's write
lock, and every writer then waited out the full busy timeout (a minute).
Store calls now run to their own end before the cancellation goes on.
"""

from __future__ import annotations

import asyncio
import contextlib

from tests.helpers import new_action, new_run, target_for


async def test_cancelled_store_calls_never_wedge_the_database(store) -> None:
    run = await new_run(store)
    action = await new_action(store, run, key="a", target_key=target_for("a"))
    assert await store.claim_action_for_execution(action["id"], 30) == "claimed"
    token = (await store.get_action(action["id"]))["fencing_token"]
    for attempt in range(60):
        call = asyncio.ensure_future(store.hold_action_lease(action["id"], token, 30))
        await asyncio.sleep(0.0005 * (attempt % 7))  # somewhere inside its transaction
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        held = await asyncio.wait_for(store.hold_action_lease(action["id"], token, 30), 5)
        assert held == "executing"
    assert await store.verify_audit_chain(run["id"])


async def test_a_cancelled_call_still_completes_what_it_started(store) -> None:
    run = await new_run(store)
    call = asyncio.ensure_future(store.set_run_status(run["id"], "running"))
    await asyncio.sleep(0)  # started
    call.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await call
    assert (await store.get_run(run["id"]))["status"] == "running"  # all or nothing: all
