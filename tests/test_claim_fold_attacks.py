"""Attacks on the SQLite claim in three trips (the lease, a plain INSERT,
with the counters, event and chain head sent in the trip of the action's
move), from an adversarial review: a claim is whole or absent whatever fails
or is cancelled, and whoever races it. Each test is one attack; SQLite
unless it says otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import event, func, select
from sqlalchemy.exc import IntegrityError, OperationalError
from temporalio.testing import ActivityEnvironment

from activities.write_activities import WriteActivities
from roundtable.models import ActionRef, ExecuteWriteInput
from roundtable.states import ClaimOutcome
from roundtable.store import ConflictError, open_store
from roundtable.store.schema import (
    ActionLeaseRow,
    ActionRow,
    AuditEventRow,
    RunRow,
    TargetFencingRow,
    TargetScopeRow,
)
from roundtable.store.sqlite_driver import OneTripConnection
from roundtable.tools.registry import ToolRegistry
from tests.helpers import (
    FailOnce,
    claim_until_done,
    listening,
    new_action,
    new_run,
    target_fields,
    two_writes_on_one_target,
)
from tests.test_claim_cut import WIDE, _overlap
from tests.test_core_claim_attacks import assert_pool_clean, counters, lease_row, orphan_lease
from tests.workflow_harness import TRUSTING


@pytest.fixture
async def sqlite_store(tmp_path) -> Any:
    async with open_store(f"sqlite+aiosqlite:///{tmp_path / 'fold.db'}") as store:
        yield store


PLACES = ["event_loop", "thread"]


def place_calls(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Where SQLite's calls run: as shipped (on the event loop while the
    connection's thread is idle: a claim's calls never suspend, so a
    cancellation requested at one is seen after the claim), or all on the
    thread (as when it is busy, or waits for another writer's lock), where
    a cancellation lands between two calls and cuts the claim."""
    if where == "thread":
        monkeypatch.setattr(OneTripConnection, "_may_run_here", lambda *_a, **_k: False)


async def head_of(store: Any, run_id: str) -> tuple[int, str]:
    async with store.session_factory() as session:
        row = (
            await session.execute(
                select(RunRow.last_event_seq, RunRow.last_event_hash).where(RunRow.id == run_id)
            )
        ).one()
    return tuple(row)


async def snapshot_of(store: Any, run: dict[str, Any], action: dict[str, Any]) -> dict[str, Any]:
    """Everything a claim of ``action`` may write."""
    row = await store.get_action(action["id"])
    lease = await lease_row(store, action["id"])
    async with store.session_factory() as session:
        leases = (await session.execute(select(func.count()).select_from(ActionLeaseRow))).scalar()
    return {
        "status": row["status"],
        "attempt_count": row["attempt_count"],
        "fencing_token": row["fencing_token"],
        "lease": None if lease is None else lease.fencing_token,
        "leases": leases,
        "counters": await counters(store, action),
        "events": [(e["seq"], e["event_type"]) for e in await store.list_events(run["id"])],
        "head": await head_of(store, run["id"]),
    }


async def assert_whole(
    store: Any, run: dict[str, Any], action: dict[str, Any], before: dict[str, Any]
) -> str:
    """Either the claim is all there or none of it: no lease without an
    executing action, no counter bump without a lease, no event without the
    action's move. Returns which."""
    now = await snapshot_of(store, run, action)
    assert await store.verify_audit_chain(run["id"])
    assert_pool_clean(store)
    if now["status"] == "approved":
        assert now == before, (now, before)
        return "nothing"
    assert now["status"] == "executing", now
    token = now["fencing_token"]
    assert now["lease"] == token, now
    assert now["attempt_count"] == before["attempt_count"] + 1, now
    assert now["counters"][0] == token, now
    if action["target_scope"] is not None:
        assert now["counters"][1] == token, now
    added = now["events"][len(before["events"]) :]
    assert now["events"][: len(before["events"])] == before["events"]
    assert [t for _, t in added] == ["action.executing"], now
    assert now["head"][0] == now["events"][-1][0]
    return "claimed"


# ------------------------------------------------------------ the UPDATE finds nothing


async def test_update_finding_no_row_rolls_back_the_writes_sent_before_it(sqlite_store) -> None:
    """Attack: the action's move matches no row (forced: a listener adds
    ``AND 0`` to the claim's UPDATE). The lease, counters, event and chain
    head already ran in that trip; ConflictError must leave none of them."""
    store = sqlite_store
    run = await new_run(store)
    action = await new_action(store, run, key="nomatch", **target_fields("nomatch"))
    before = await snapshot_of(store, run, action)
    told: list[Any] = []
    store.db.observers.append(told.append)

    def no_match(_c: Any, _cur: Any, sql: str, params: Any, _ctx: Any, _many: bool) -> Any:
        if sql.startswith("UPDATE actions SET status") and "RETURNING" in sql:
            sql = sql.replace(" RETURNING", " AND 0 RETURNING", 1)
        return sql, params

    event.listen(store.engine.sync_engine, "before_cursor_execute", no_match, retval=True)
    try:
        with pytest.raises(ConflictError, match="changed while being claimed"):
            await store.claim_for_execution(action["id"], 30)
    finally:
        event.remove(store.engine.sync_engine, "before_cursor_execute", no_match)
    assert await assert_whole(store, run, action, before) == "nothing"
    assert told == []
    claim = await store.claim_for_execution(action["id"], 30)
    assert claim.outcome == ClaimOutcome.CLAIMED and claim.action["fencing_token"] == 1
    assert await assert_whole(store, run, action, before) == "claimed"


# ------------------------------------------------------------ each queued write fails

# (name, table, trigger timing/event, needs a finished earlier claim on the target)
FAILING_WRITES = [
    ("lease", "action_leases", "BEFORE INSERT", False),
    ("target_counter_insert", "target_fencing", "BEFORE INSERT", False),
    ("target_counter_update", "target_fencing", "BEFORE UPDATE", True),
    ("scope_counter_insert", "target_scopes", "BEFORE INSERT", False),
    ("scope_counter_update", "target_scopes", "BEFORE UPDATE", True),
    ("event", "audit_events", "BEFORE INSERT", False),
    ("head", "runs", "BEFORE UPDATE OF last_event_seq", False),
    ("action", "actions", "BEFORE UPDATE OF status", False),
    ("lease_after", "action_leases", "AFTER INSERT", False),
    ("event_after", "audit_events", "AFTER INSERT", False),
]


@pytest.mark.parametrize("mode", ["ABORT", "ROLLBACK", "FAIL"])
@pytest.mark.parametrize(("name", "table", "when", "earlier"), FAILING_WRITES)
async def test_any_queued_write_failing_leaves_nothing(
    sqlite_store, name: str, table: str, when: str, earlier: bool, mode: str
) -> None:
    """Attack: each of the writes sent in the action's trip fails in turn (a
    trigger raises: ABORT, ROLLBACK, or FAIL, which keeps the statement's
    own earlier changes). The claim must fail with the database's error and
    keep nothing; the target must be claimable afterwards with the next token."""
    store = sqlite_store
    run = await new_run(store)
    target = target_fields(f"fail-{name}")
    expected_token = 1
    if earlier:
        first = await new_action(store, run, key=f"first-{name}", **target)
        claim = await store.claim_for_execution(first["id"], 30)
        assert claim.outcome == ClaimOutcome.CLAIMED
        assert await store.record_action_terminal_result(
            first["id"], "succeeded", {}, fencing_token=claim.action["fencing_token"]
        )
        expected_token = 2
    action = await new_action(store, run, key=f"fail-{name}", **target)
    before = await snapshot_of(store, run, action)
    told: list[Any] = []
    store.db.observers.append(told.append)
    raw = sqlite3.connect(store.engine.url.database, isolation_level=None)
    try:
        raw.execute(
            f"CREATE TRIGGER review_fail {when} ON {table} "
            f"BEGIN SELECT RAISE({mode}, 'injected {name}'); END"
        )
        with pytest.raises(IntegrityError, match=f"injected {name}"):
            await store.claim_for_execution(action["id"], 30)
    finally:
        raw.execute("DROP TRIGGER IF EXISTS review_fail")
        raw.close()
    assert await assert_whole(store, run, action, before) == "nothing"
    assert told == []
    claim = await store.claim_for_execution(action["id"], 30)
    assert claim.outcome == ClaimOutcome.CLAIMED
    assert claim.action["fencing_token"] == expected_token
    assert await assert_whole(store, run, action, before) == "claimed"


@pytest.mark.parametrize(
    "refused",
    [
        "INSERT INTO action_leases",
        "INSERT INTO target_fencing",
        "INSERT INTO audit_events",
        "UPDATE runs",
        "UPDATE actions",
    ],
)
async def test_a_write_refused_as_it_is_queued_leaves_nothing(sqlite_store, refused: str) -> None:
    """Attack: a before-listener refuses one of the claim's writes when it is
    prepared (as the store refuses unstorable text), after earlier writes were
    queued but before any was sent. Nothing stays; the queue is not carried
    into the next transaction on the pooled connection."""
    store = sqlite_store
    run = await new_run(store)
    target = {"target_key": target_fields(f"refuse-{refused}")["target_key"]}  # no scope
    action = await new_action(store, run, key="refuse", **target)
    before = await snapshot_of(store, run, action)

    class Refused(Exception):
        pass

    def refuse(_c: Any, _cur: Any, sql: str, params: Any, _ctx: Any, _many: bool) -> None:
        if sql.startswith(refused):
            raise Refused(sql)

    with listening(store.engine, "before_cursor_execute", refuse), pytest.raises(Refused):
        await store.claim_for_execution(action["id"], 30)
    assert await assert_whole(store, run, action, before) == "nothing"
    other = await new_action(
        store, run, key="refuse-other", target_key=target_fields("ro")["target_key"]
    )
    assert await store.claim_action_for_execution(other["id"], 30) == "claimed"
    assert await snapshot_of(store, run, action) == {
        **before,
        "leases": before["leases"] + 1,
        "events": (await snapshot_of(store, run, action))["events"],
        "head": await head_of(store, run["id"]),
    }
    claim = await store.claim_for_execution(action["id"], 30)
    assert claim.outcome == ClaimOutcome.CLAIMED and claim.action["fencing_token"] == 1


# ------------------------------------------------------------ the commit fails


@pytest.mark.parametrize("how", ["listener", "disk_error_before", "lock_lost_busy"])
async def test_a_claim_whose_commit_fails_keeps_nothing_and_says_so(
    sqlite_store, monkeypatch, how: str
) -> None:
    """Attack: a granting claim's commit fails (a commit listener raises; the
    COMMIT itself fails with a disk error or SQLITE_BUSY before it lands). The
    error surfaces, nothing of the claim stays, no note is told, and the
    target is claimable afterwards with token 1."""
    store = sqlite_store
    run = await new_run(store)
    action = await new_action(store, run, key=f"commit-{how}", **target_fields(f"c-{how}"))
    before = await snapshot_of(store, run, action)
    told: list[Any] = []
    store.db.observers.append(told.append)

    class Injected(Exception):
        pass

    listener = FailOnce(Injected("commit listener"))
    ended = OneTripConnection._ended

    def failing_end(self: Any, end: str) -> bool:
        if end == "commit" and listener.armed:
            listener.armed = False
            message = "disk I/O error" if how == "disk_error_before" else "database is locked"
            raise sqlite3.OperationalError(message)
        return ended(self, end)

    if how == "listener":
        event.listen(store.engine.sync_engine, "commit", listener)
        expected: Any = Injected
    else:
        monkeypatch.setattr(OneTripConnection, "_ended", failing_end)
        expected = OperationalError
    try:
        with pytest.raises(expected):
            await store.claim_for_execution(action["id"], 30)
    finally:
        if how == "listener":
            event.remove(store.engine.sync_engine, "commit", listener)
    assert await assert_whole(store, run, action, before) == "nothing"
    assert told == []
    claim = await store.claim_for_execution(action["id"], 30)
    assert claim.outcome == ClaimOutcome.CLAIMED and claim.action["fencing_token"] == 1


async def test_a_commit_that_lands_but_reports_an_error_is_whole_and_settles_unknown(
    sqlite_store, monkeypatch
) -> None:
    """Attack: the COMMIT lands on disk, then the driver reports an error (an
    ambiguous commit). The claim is whole (all of it committed), and the
    activity's settling, which is what follows a failed execute_write, makes
    the action unknown rather than approved again: the write never runs
    twice."""
    store = sqlite_store
    run = await new_run(store)
    action = await new_action(store, run, key="ambiguous", **target_fields("ambiguous"))
    before = await snapshot_of(store, run, action)
    ended = OneTripConnection._ended
    armed = [True]

    def landed_then_failed(self: Any, end: str) -> bool:
        result = ended(self, end)
        if end == "commit" and armed[0]:
            armed[0] = False
            raise sqlite3.OperationalError("disk I/O error after the commit")
        return result

    monkeypatch.setattr(OneTripConnection, "_ended", landed_then_failed)
    writes = WriteActivities(store, ToolRegistry(), authority=TRUSTING)
    inp = ExecuteWriteInput(
        action_id=action["id"], seat="seat-1", lease_seconds=30, heartbeat_interval_seconds=1
    )
    with pytest.raises(OperationalError):
        await ActivityEnvironment().run(writes.execute_write, inp)
    assert await assert_whole(store, run, action, before) == "claimed"
    settled = await ActivityEnvironment().run(
        writes.settle_write, ActionRef(action_id=action["id"])
    )
    assert settled.status == "unknown"
    assert (await store.claim_for_execution(action["id"], 30)).outcome == ClaimOutcome.UNKNOWN


# ------------------------------------------------------------ cancellation


@pytest.mark.parametrize("where", PLACES)
@pytest.mark.parametrize("shielded", [False, True])
async def test_a_claim_cancelled_at_every_turn_is_whole_or_absent(
    sqlite_store, monkeypatch, shielded: bool, where: str
) -> None:
    """Attack: the claim's task cancelled after k turns of the event loop,
    k = 0..40 and longer: through the public call (run to completion, the caller sees
    CancelledError) and through ``Leases._claim`` itself (unshielded: the
    cancellation lands at whatever await the claim is at). Every time, the
    claim is whole or absent, the pool and the writer queue are left clean,
    and the target answers the next claim consistently."""
    place_calls(monkeypatch, where)
    store = sqlite_store
    run = await new_run(store)
    outcomes: dict[str, int] = {}
    # 0..40 turns, then longer waits until the claim has had the time to land
    # before its cancellation (how many turns that takes is the thread's pace).
    for k in [*range(41), 60, 100, 200, 500, 1000, 3000, 10000, 30000]:
        if k > 40 and (shielded or landed(outcomes)):
            break
        target = target_fields(f"cancel-{shielded}-{k}")
        action = await new_action(store, run, key=f"cancel-{shielded}-{k}", **target)
        follower = await new_action(store, run, key=f"follow-{shielded}-{k}", **target)
        before = await snapshot_of(store, run, action)
        if shielded:
            task = asyncio.ensure_future(store.claim_for_execution(action["id"], 30))
        else:
            task = asyncio.ensure_future(store.leases._claim(action["id"], 30, hand_over=True))
        for _ in range(k):
            await asyncio.sleep(0)
        task.cancel()
        try:
            await task
            ended = "finished"
        except asyncio.CancelledError:
            ended = "cancelled"
        # to_completion: the caller's own await may return before the pool
        # has taken the connection back; let the loop settle.
        for _ in range(20):
            await asyncio.sleep(0)
        whole = await assert_whole(store, run, action, before)
        outcomes[f"{ended}/{whole}"] = outcomes.get(f"{ended}/{whole}", 0) + 1
        if shielded and k > 0:
            # Run to completion: once the call had started (k = 0 cancels the
            # task before its first step), the claim always lands whole.
            assert whole == "claimed", (k, ended)
        expected = "target_busy" if whole == "claimed" else "claimed"
        assert await store.claim_action_for_execution(follower["id"], 30) == expected, k
    # Both ends were reached: cancelled before the claim landed, and after it
    # had (a cancellation inside the commit's trip itself, the narrowest case,
    # is the trip-by-trip test's below).
    if not shielded:
        assert outcomes.get("cancelled/nothing") and landed(outcomes), outcomes


def landed(outcomes: dict[str, int]) -> bool:
    return bool(outcomes.get("cancelled/claimed") or outcomes.get("finished/claimed"))


async def pending_cancellation() -> None:
    """Where a cancellation requested at a call that ran on the event loop
    surfaces if the claim never suspended after it (its connection held
    between writers, nothing of the claim waits): at the task's next
    suspension, after the claim has ended."""
    await asyncio.sleep(0)


class CancelAtTrip:
    """Trips to SQLite's thread watched: while ``armed``, the first that
    ``chosen`` picks (given the call and its arguments) cancels the task that
    sends it, as the call is queued (the thread still runs it) or, with
    ``before_queueing``, just before; then it disarms."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        chosen: Callable[[Any, tuple[Any, ...]], bool],
        before_queueing: bool,
    ) -> None:
        self.armed = False
        queue = OneTripConnection._execute

        async def cancelling(connection: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
            if self.armed and chosen(fn, args):
                self.armed = False
                if before_queueing:
                    raise asyncio.CancelledError()
                asyncio.current_task().cancel()  # type: ignore[union-attr]
            return await queue(connection, fn, *args, **kwargs)

        monkeypatch.setattr(OneTripConnection, "_execute", cancelling)


async def two_on_one_target(store: Any, name: str) -> tuple[Any, Any, Any, dict[str, Any]]:
    """A run with two writes on one target (the one claimed, the one that
    follows), the pool's connection known idle, and what a claim may write,
    as it stands."""
    run, action, follower = await two_writes_on_one_target(store, name)
    await store.get_action(action["id"])
    return run, action, follower, await snapshot_of(store, run, action)


async def claim_cancelled_at(
    store: Any, monkeypatch: pytest.MonkeyPatch, name: str, trip: int, before_queueing: bool
) -> tuple[str, str, dict[str, Any]]:
    """The unshielded claim of a write with a follower on its target,
    cancelled at its ``trip``-th call into SQLite: how it ended (finished
    or cancelled), what of it is kept, and the follower."""
    run, action, follower, before = await two_on_one_target(store, name)
    seen = [0]

    def nth(_fn: Any, _args: tuple[Any, ...]) -> bool:
        seen[0] += 1
        return seen[0] == trip

    cut = CancelAtTrip(monkeypatch, nth, before_queueing)
    cut.armed = True
    ended = "cancelled"
    try:
        await store.leases._claim(action["id"], 30, hand_over=True)
        ended = "finished"
        await pending_cancellation()
    except asyncio.CancelledError:
        pass
    cut.armed = False
    for _ in range(20):
        await asyncio.sleep(0)
    return ended, await assert_whole(store, run, action, before), follower


async def test_on_the_thread_a_claim_cancelled_at_a_trip_is_cut_and_leaves_nothing(
    sqlite_store, monkeypatch
) -> None:
    """Coverage for the attack below: on the event loop a claim's calls
    never suspend, so a cancellation requested at one is seen after the
    claim committed; the claim is cut between its calls (and must leave
    nothing) only where they run on the thread (the thread busy, or a lock
    waited for), which its ``thread`` placement forces. There some trip
    must end with the claim cancelled and nothing kept, or the
    rollback-on-cancel path goes untested (found by the review of the
    calls on the event loop)."""
    place_calls(monkeypatch, "thread")
    outcomes = []
    for trip in range(2, 6):
        with monkeypatch.context() as patch:
            ended, whole, _ = await claim_cancelled_at(
                sqlite_store, patch, f"cut-{trip}", trip, before_queueing=False
            )
        outcomes.append((trip, ended, whole))
    assert ("cancelled", "nothing") in {(ended, whole) for _, ended, whole in outcomes}, outcomes


@pytest.mark.parametrize("where", PLACES)
@pytest.mark.parametrize("before_queueing", [False, True])
@pytest.mark.parametrize("trip", [1, 2, 3, 4, 5])
async def test_a_claim_cancelled_at_each_trip_is_whole_or_absent(
    sqlite_store, monkeypatch, trip: int, before_queueing: bool, where: str
) -> None:
    """Attack: the unshielded claim (``Leases._claim``) cancelled exactly at
    its n-th trip to SQLite's thread (the read, the writes with the action's
    move, the commit, the rollback): either as the call is queued (the thread
    runs it, the task no longer waits) or just before it is queued. Each
    with SQLite's calls where they run (``place_calls``)."""
    place_calls(monkeypatch, where)
    store = sqlite_store
    name = f"trip-{trip}-{before_queueing}"
    ended, whole, follower = await claim_cancelled_at(
        store, monkeypatch, name, trip, before_queueing
    )
    if ended == "finished":
        assert whole == "claimed"
    expected = "target_busy" if whole == "claimed" else "claimed"
    assert await store.claim_action_for_execution(follower["id"], 30) == expected


@pytest.mark.parametrize("where", PLACES)
@pytest.mark.parametrize("before_queueing", [False, True])
async def test_a_failed_claim_cancelled_during_its_rollback_leaves_nothing(
    sqlite_store, monkeypatch, before_queueing: bool, where: str
) -> None:
    """Attack: the writes' trip fails (the event collides: a trigger), and the
    unshielded claim is cancelled at its rollback's trip (as it is queued, or
    before it is). Nothing of the claim may stay, the connection must go back
    to the pool rolled back, and the writer queue must be free."""
    place_calls(monkeypatch, where)
    store = sqlite_store
    run, action, follower, before = await two_on_one_target(store, f"rb-{before_queueing}")

    def rollback(fn: Any, args: tuple[Any, ...]) -> bool:
        return getattr(fn, "__name__", "") == "_ended" and args == ("rollback",)

    cut = CancelAtTrip(monkeypatch, rollback, before_queueing)
    raw = sqlite3.connect(store.engine.url.database, isolation_level=None)
    try:
        raw.execute(
            "CREATE TRIGGER review_fail BEFORE INSERT ON audit_events "
            "BEGIN SELECT RAISE(ABORT, 'injected'); END"
        )
        cut.armed = True
        with pytest.raises((asyncio.CancelledError, IntegrityError)):
            await store.leases._claim(action["id"], 30, hand_over=True)
        assert not cut.armed, "the rollback was never queued"
        with contextlib.suppress(asyncio.CancelledError):
            await pending_cancellation()
    finally:
        cut.armed = False
        raw.execute("DROP TRIGGER IF EXISTS review_fail")
        raw.close()
    for _ in range(20):
        await asyncio.sleep(0)
    assert await assert_whole(store, run, action, before) == "nothing"
    # The pooled connection holds no transaction: another process can write.
    other = sqlite3.connect(store.engine.url.database, isolation_level=None, timeout=2)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute("ROLLBACK")
    finally:
        other.close()
    assert await store.claim_action_for_execution(follower["id"], 30) == "claimed"


# ------------------------------------------------------------ racing claimers


async def test_two_stores_on_one_file_racing_overlapping_targets(tmp_path) -> None:
    """Attack: two store instances (two engines, two writer queues, so only
    SQLite's BEGIN IMMEDIATE arbitrates) claim overlapping targets (a wide
    write and specific keys in one scope) all at once, round after round,
    while the previous round's holders record their results. A lease the read
    missed would now surface as IntegrityError; none may. Never two
    overlapping holders; tokens rise per key and per scope."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'two.db'}"
    rng = random.Random(7)  # noqa: S311
    async with open_store(url) as one, open_store(url) as two:
        runs = [await new_run(one) for _ in range(4)]
        actions: list[dict[str, Any]] = []
        for copy in range(3):
            actions.append(
                await new_action(
                    one, rng.choice(runs), key=f"wide-{copy}", **target_fields(WIDE, "ns-r")
                )
            )
        for key in range(4):
            for copy in range(3):
                actions.append(
                    await new_action(
                        one,
                        rng.choice(runs),
                        key=f"k{key}-{copy}",
                        **target_fields(f"k{key}", "ns-r"),
                    )
                )
        by_id = {a["id"]: a for a in actions}
        waiting = [a["id"] for a in actions]
        holding: list[str] = []
        top = 0
        key_tokens: dict[str, list[int]] = {}
        rounds = 0
        while waiting or holding:
            rounds += 1
            assert rounds < 200
            rng.shuffle(waiting)
            calls = [rng.choice((one, two)).claim_action_for_execution(a, 60) for a in waiting]
            calls += [
                rng.choice((one, two)).record_action_terminal_result(a, "succeeded", {})
                for a in holding
            ]
            results = await asyncio.gather(*calls, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            assert not errors, errors
            outcomes = dict(zip(waiting, results[: len(waiting)], strict=True))
            assert set(outcomes.values()) <= {"claimed", "target_busy"}, outcomes
            winners = [a for a, o in outcomes.items() if o == "claimed"]
            for i, first in enumerate(winners):
                for second in winners[i + 1 :]:
                    assert not _overlap(by_id[first], by_id[second])
            tokens = []
            for winner in winners:
                row = await one.get_action(winner)
                assert row["attempt_count"] == 1
                tokens.append(row["fencing_token"])
                key_tokens.setdefault(row["target_key"], []).append(row["fencing_token"])
            if tokens:
                assert len(set(tokens)) == len(tokens)
                assert min(tokens) > top
                top = max(tokens)
            waiting = [a for a in waiting if a not in winners]
            holding = winners
        for tokens in key_tokens.values():
            assert tokens == sorted(set(tokens))
        for run in runs:
            assert await one.verify_audit_chain(run["id"])
        assert_pool_clean(one)
        assert_pool_clean(two)


_CLAIMER = textwrap.dedent(
    """
    import asyncio, json, sys
    from roundtable.store import open_store
    from tests.helpers import claim_until_done

    async def main(url, ids):
        async with open_store(url) as store:
            seen = await claim_until_done(store, ids)
        print(json.dumps(seen))

    asyncio.run(main(sys.argv[1], sys.argv[2:]))
    """
)


async def test_two_processes_claiming_one_set_of_overlapping_writes(tmp_path) -> None:
    """Attack: another process claims (and finishes) the same writes on
    overlapping targets while this one does, both looping until every write
    is done. No claim errs (a lease a read missed would be IntegrityError),
    each write is claimed once, tokens are distinct in the scope and rise
    per key, the chains verify."""
    path = tmp_path / "procs.db"
    url = f"sqlite+aiosqlite:///{path}"
    async with open_store(url) as store:
        run = await new_run(store)
        actions = [await new_action(store, run, key="w", **target_fields(WIDE, "ns-p"))]
        for key in range(3):
            for copy in range(4):
                actions.append(
                    await new_action(
                        store, run, key=f"p{key}-{copy}", **target_fields(f"p{key}", "ns-p")
                    )
                )
        ids = [a["id"] for a in actions]
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        child = subprocess.Popen(  # noqa: ASYNC220 (read by a thread below)
            [sys.executable, "-c", _CLAIMER, url, *reversed(ids)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=os.getcwd(),
        )
        try:
            mine = await claim_until_done(store, ids)
            out, err = await asyncio.to_thread(child.communicate, timeout=300)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        assert child.returncode == 0, err.decode()
        theirs = json.loads(out.decode().strip().splitlines()[-1])
        assert "errors" not in mine, mine
        assert "errors" not in theirs, theirs
        assert mine.get("claimed", 0) + theirs.get("claimed", 0) == len(ids), (mine, theirs)
        tokens = []
        for action in actions:
            row = await store.get_action(action["id"])
            assert row["status"] == "succeeded" and row["attempt_count"] == 1, row
            tokens.append(row["fencing_token"])
        assert sorted(tokens) == list(range(1, len(ids) + 1))
        executing = [
            e["payload"]["fencing_token"]
            for e in await store.list_events(run["id"])
            if e["event_type"] == "action.executing"
        ]
        assert executing == sorted(executing) and len(executing) == len(ids)
        assert await store.verify_audit_chain(run["id"])
        assert_pool_clean(store)


async def test_redelivered_claims_from_two_stores_start_the_write_once(tmp_path) -> None:
    """Attack: one approved write claimed many times at once from two store
    instances (redelivered attempts): exactly one claimed, the rest
    in_progress, no error, one executing event, one lease."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'redeliver.db'}"
    async with open_store(url) as one, open_store(url) as two:
        run = await new_run(one)
        action = await new_action(one, run, key="again", **target_fields("again"))
        results = await asyncio.gather(
            *(s.claim_action_for_execution(action["id"], 30) for s in [one, two] * 8),
            return_exceptions=True,
        )
        assert sorted(map(str, results)) == ["claimed"] + ["in_progress"] * 15, results
        types = [e["event_type"] for e in await one.list_events(run["id"])]
        assert types.count("action.executing") == 1
        assert (await one.get_action(action["id"]))["attempt_count"] == 1
        assert await one.verify_audit_chain(run["id"])
        assert_pool_clean(one)
        assert_pool_clean(two)


# ------------------------------------------------------------ what the executor sees


async def test_execute_write_on_a_lease_its_claim_cannot_see_runs_nothing(sqlite_store) -> None:
    """Attack: the execute_write activity meets the claim's new IntegrityError
    (where it used to get target_busy). The tool must not run, the action
    must stay approved (not stuck executing, not unknown), settle_write (what
    the workflow runs after a failed execute_write) must leave it approved
    so the workflow retries it, and nothing of the claim may stay."""
    store = sqlite_store
    run = await new_run(store)
    action = await new_action(store, run, key="orphan", **target_fields("orphan"))
    await orphan_lease(store, action)
    before = await snapshot_of(store, run, action)
    told: list[Any] = []
    store.db.observers.append(told.append)
    writes = WriteActivities(store, ToolRegistry(), authority=TRUSTING)
    inp = ExecuteWriteInput(
        action_id=action["id"], seat="seat-1", lease_seconds=30, heartbeat_interval_seconds=1
    )
    for _ in range(3):  # the workflow's retries
        with pytest.raises(IntegrityError):
            await ActivityEnvironment().run(writes.execute_write, inp)
        settled = await ActivityEnvironment().run(
            writes.settle_write, ActionRef(action_id=action["id"])
        )
        assert settled.status == "approved"
        assert await snapshot_of(store, run, action) == before
    assert_pool_clean(store)
    # What the change costs: the busy target is no longer counted as busy.
    assert told == []


# ------------------------------------------------------------ token limits


async def test_a_counter_at_its_ceiling_fails_the_claim_whole(sqlite_store) -> None:
    """Attack: the target's counter at the largest 64-bit integer: the next
    token does not fit. The claim must fail and keep nothing."""
    store = sqlite_store
    run = await new_run(store)
    target = target_fields("ceiling")
    action = await new_action(store, run, key="ceiling", **target)
    async with store.session_factory() as session, session.begin():
        await session.execute(
            TargetFencingRow.__table__.insert().values(
                target_key=target["target_key"], last_token=2**63 - 1
            )
        )
    before = await snapshot_of(store, run, action)
    with pytest.raises(Exception):  # noqa: B017 (which error is not the point)
        await store.claim_for_execution(action["id"], 30)
    assert await assert_whole(store, run, action, before) == "nothing"


# Silence unused-import linters for names used only in some branches.
_ = (ActionRow, AuditEventRow, TargetScopeRow)
