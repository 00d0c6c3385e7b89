"""Two transitions of one row at the same instant, many times over, on SQLite
and PostgreSQL: exactly one wins, the loser is refused cleanly, and the row,
its action and its audit log agree every time."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from roundtable.store import ConflictError, Store
from tests.helpers import new_action, new_run, set_column, target_fields

# `make test` races each pair 200 times (each order 100 times); `make stress`
# 500 times, as the suite did before it neared its 30 minutes.
ROUNDS = int(os.environ.get("RACE_ROUNDS", "200"))
ENDINGS = {"approval.approved", "approval.rejected", "approval.expired"}


async def waiting(store: Store, n: int, deadline: datetime) -> dict[str, Any]:
    run = await new_run(store)
    return await new_action(
        store,
        run,
        key=f"race-{n}",
        status="waiting_approval",
        approval_expires_at=deadline,
        **target_fields(f"race-{n}"),
    )


async def read_time(store: Store) -> float:
    """How long one of the store's reads takes here, in seconds (the median
    of five): the unit a race's head start is swept in, so the sweep
    covers the same number of round trips on a local server and a remote."""
    run = await new_run(store)
    taken = []
    for _ in range(5):
        started = time.perf_counter()
        await store.get_run(run["id"])
        taken.append(time.perf_counter() - started)
    return statistics.median(taken)


async def both(n: int, first: Any, second: Any, unit: float) -> tuple[Any, Any]:
    """Both at once; on SQLite, whose writers queue in this process, whoever
    asks first goes first, so the order alternates from round to round. The
    one asked first is ahead by a head start swept from round to round, 0
    to 1.75 ``unit`` (a read's time, about three round trips on PostgreSQL):
    there the two sides' paths to the row can differ by a round trip or
    more (a statement more before the lock, say), and a fixed start would
    let the shorter path win every round. Which side wins a round is then
    set mostly by its head start; what each round checks is that exactly
    one did, cleanly."""
    head_start = (n // 2 % 8) * unit / 4

    async def behind(call: Any) -> Any:
        await asyncio.sleep(head_start)
        return await quietly(call)

    if n % 2:
        later, earlier = await asyncio.gather(quietly(second), behind(first))
        return earlier, later
    return tuple(await asyncio.gather(quietly(first), behind(second)))


async def quietly(call: Any) -> Any:
    """A refusal (the other side won) is an answer, not a failure."""
    try:
        return await call
    except ConflictError as refused:
        return refused


async def endings_of(store: Store, run_id: str, approval_id: str) -> list[str]:
    events = await store.list_events(run_id)
    return [
        e["event_type"]
        for e in events
        if e["event_type"] in ENDINGS and e["payload"].get("approval_id") == approval_id
    ]


async def test_approve_against_expire_has_exactly_one_outcome(store: Store) -> None:
    outcomes: dict[str, int] = {}
    unit = await read_time(store)
    for n in range(ROUNDS):
        action = await waiting(store, n, datetime.now(UTC) + timedelta(hours=1))
        approval_id = action["approval_id"]
        deadline = (await store.get_approval(approval_id))["expires_at"]
        # The workflow's timer fires for its deadline as a person approves.
        await both(
            n,
            store.decide_approval(approval_id, "approved", "ops"),
            store.expire_approval(approval_id, deadline),
            unit,
        )
        approval = await store.get_approval(approval_id)
        settled = await store.get_action(action["id"])
        assert approval["status"] in ("approved", "expired"), approval
        wanted = "approved" if approval["status"] == "approved" else "rejected"
        assert settled["status"] == wanted, (approval, settled)
        ends = await endings_of(store, action["run_id"], approval_id)
        assert ends == [f"approval.{approval['status']}"], ends
        outcomes[approval["status"]] = outcomes.get(approval["status"], 0) + 1
    assert sum(outcomes.values()) == ROUNDS
    assert set(outcomes) == {"approved", "expired"}, outcomes  # both sides won sometimes


async def test_extend_against_expire_has_exactly_one_outcome(store: Store) -> None:
    unit = await read_time(store)
    for n in range(ROUNDS):
        action = await waiting(store, n, datetime.now(UTC) + timedelta(hours=1))
        approval_id = action["approval_id"]
        deadline = (await store.get_approval(approval_id))["expires_at"]
        extended, expired = await both(
            n,
            store.extend_approval(approval_id, 600, "ops", 3600),
            store.expire_approval(approval_id, deadline),
            unit,
        )
        approval = await store.get_approval(approval_id)
        if approval["status"] == "expired":
            assert isinstance(extended, ConflictError), extended
            assert approval["expires_at"] == deadline
        else:
            assert approval["status"] == "pending" and expired is False
            assert approval["expires_at"] == deadline + timedelta(seconds=600)
        events = await store.list_events(action["run_id"])
        kinds = [e["event_type"] for e in events]
        assert kinds.count("approval.extended") + kinds.count("approval.expired") == 1, kinds


async def test_reconcile_against_recover_never_leaves_a_mixed_state(store: Store) -> None:
    """The sweep makes a lapsed lease unknown as an operator reconciles: the
    operator either finds it not yet unknown (refused) or settles it."""
    from roundtable.store.schema import ActionLeaseRow

    unit = await read_time(store)
    for n in range(ROUNDS):
        run = await new_run(store)
        action = await new_action(store, run, key=f"lapse-{n}", **target_fields(f"lapse-{n}"))
        assert await store.claim_action_for_execution(action["id"], 30) == "claimed"
        past = datetime.now(UTC) - timedelta(seconds=1)
        await set_column(
            store,
            ActionLeaseRow,
            ActionLeaseRow.action_id == action["id"],
            lease_expires_at=past,
        )
        _, reconciled = await both(
            n,
            store.recover_expired_action_leases(run_id=run["id"]),
            store.reconcile_action(action["id"], "failed", "ops", "checked"),
            unit,
        )
        settled = await store.get_action(action["id"])
        kinds = [e["event_type"] for e in await store.list_events(run["id"])]
        assert kinds.count("action.unknown") == 1, kinds
        if isinstance(reconciled, ConflictError):
            assert settled["status"] == "unknown"
            assert "action.reconciled" not in kinds
        else:
            assert settled["status"] == "failed"
            assert kinds.index("action.unknown") < kinds.index("action.reconciled")
