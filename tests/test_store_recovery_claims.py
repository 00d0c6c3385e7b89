"""The store's claim on a run's recovery (Runs.begin_recovery): one recovery
of an execution at a time, none once it was recovered, at most a few per run;
on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from roundtable.store import ConflictError
from tests.helpers import new_run

FRESH = timedelta(minutes=5)


async def begin(  # type: ignore[no-untyped-def]
    store,
    run,
    execution: str = "exec-1",
    by: str = "op-1",
    most: int = 3,
    stale_after: timedelta = FRESH,
) -> str:
    """A claim on ``execution``'s recovery, as recover_run takes one."""
    return await store.begin_recovery(
        run["id"],
        from_execution=execution,
        by=by,
        note=f"{by}: tasks fail with a nondeterminism",
        reset_to_event=49,
        most=most,
        stale_after=stale_after,
    )


async def test_two_operators_at_once_claim_once(store) -> None:
    run = await new_run(store)
    results = await asyncio.gather(
        begin(store, run, by="op-a"), begin(store, run, by="op-b"), return_exceptions=True
    )
    refused = [r for r in results if isinstance(r, ConflictError)]
    assert len(refused) == 1 and "under way" in str(refused[0])
    begun = [
        e for e in await store.list_events(run["id"]) if e["event_type"] == "run.recovery_begun"
    ]
    assert len(begun) == 1
    assert await store.verify_audit_chain(run["id"])


async def test_a_failed_reset_releases_the_claim_and_a_recovered_execution_is_done(store) -> None:
    run = await new_run(store)
    claim = await begin(store, run)
    await store.end_recovery(
        run["id"], claim=claim, from_execution="exec-1", to_execution=None, failure="x"
    )
    claim = await begin(store, run, by="op-2")  # claimable again
    await store.end_recovery(run["id"], claim=claim, from_execution="exec-1", to_execution="exec-2")
    with pytest.raises(ConflictError, match="recovered already"):
        await begin(store, run, by="op-3")
    await begin(store, run, execution="exec-2")  # its new execution stalled in turn
    kinds = [e["event_type"] for e in await store.list_events(run["id"])][-5:]
    assert kinds == [
        "run.recovery_begun",
        "run.recovery_failed",
        "run.recovery_begun",
        "run.recovered",
        "run.recovery_begun",
    ]


async def test_a_claim_left_unfinished_goes_stale(store) -> None:
    """A process that died between its claim and the reset's end leaves the
    claim; once it is older than any reset takes, another may claim."""
    run = await new_run(store)
    await begin(store, run)
    with pytest.raises(ConflictError, match="under way"):
        await begin(store, run, by="op-2")
    # Stale at once: the same claim, judged with no time allowed to it.
    await begin(store, run, by="op-2", stale_after=timedelta(0))


async def test_a_run_recovered_too_often_is_left_to_a_person(store) -> None:
    run = await new_run(store)
    for n in range(2):
        claim = await begin(store, run, execution=f"exec-{n}", most=2)
        await store.end_recovery(
            run["id"], claim=claim, from_execution=f"exec-{n}", to_execution=f"exec-{n + 1}"
        )
    with pytest.raises(ConflictError, match="recovered 2 times"):
        await begin(store, run, execution="exec-2", most=2)


async def test_a_stale_claimers_end_does_not_release_the_live_claim(store) -> None:
    """Found in review: A's claim went stale, B claimed, then A's reset failed
    and its end released B's claim, so C could reset beside B."""
    run = await new_run(store)
    a = await begin(store, run, by="op-a")
    b = await begin(store, run, by="op-b", stale_after=timedelta(0))  # A's is stale to B
    assert a != b
    await store.end_recovery(run["id"], claim=a, from_execution="exec-1", to_execution=None)
    with pytest.raises(ConflictError, match=r"under way \(begun by op-b"):
        await begin(store, run, by="op-c")  # B's claim still holds
