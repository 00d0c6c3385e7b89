"""The claim in few statements (issue 12), on both databases: how many
statements a claim sends, and that many concurrent claimers on overlapping
targets (specific keys and namespace-wide writes, in several scopes, from
several runs, while earlier holders release) never hold overlapping leases
and always get rising tokens."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import select

from roundtable.store import ClaimOutcome
from roundtable.store.schema import ActionLeaseRow, ActionRow
from tests.helpers import listening, new_action, new_run, target_fields

WIDE = None  # an unusable key field: the key covers the whole namespace

# Statements per claim (SQLAlchemy cursor events: BEGIN IMMEDIATE counts on
# SQLite; asyncpg's own BEGIN and COMMIT are not seen on PostgreSQL).
CLAIMED = {"postgresql": 2, "sqlite": 7}  # SQLite: BEGIN, read, lease, counter, action, event, head
CLAIMED_IN_SCOPE = {"postgresql": 2, "sqlite": 8}  # … and the scope's counter
REFUSED = {"postgresql": 2, "sqlite": 2}


@contextmanager
def counting(store: Any) -> Iterator[list[str]]:
    seen: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        seen.append(statement)

    with listening(store.engine, "before_cursor_execute", count):
        yield seen


async def test_a_claim_is_two_statements_on_postgresql_and_few_on_sqlite(store) -> None:
    dialect = store.engine.dialect.name
    run = await new_run(store)
    plain = await new_action(store, run, key="plain", **target_fields("plain", namespace="solo"))
    scoped = await new_action(store, run, key="scoped", **target_fields("task-1"))
    busy = await new_action(store, run, key="busy", **target_fields("task-1"))
    # A key without a scope (as before scopes existed).
    bare = await new_action(store, run, key="bare", target_key=target_fields("bare")["target_key"])

    with counting(store) as seen:
        claim = await store.claim_for_execution(bare["id"], 30)
    assert claim.outcome == ClaimOutcome.CLAIMED and claim.action["status"] == "executing"
    assert len(seen) == CLAIMED[dialect], seen

    with counting(store) as seen:
        assert (await store.claim_for_execution(plain["id"], 30)).outcome == "claimed"
    assert len(seen) == CLAIMED_IN_SCOPE[dialect], seen

    with counting(store) as seen:
        assert (await store.claim_for_execution(scoped["id"], 30)).outcome == "claimed"
    assert len(seen) == CLAIMED_IN_SCOPE[dialect], seen

    with counting(store) as seen:
        assert (await store.claim_for_execution(busy["id"], 30)).outcome == "target_busy"
    assert len(seen) == REFUSED[dialect], seen

    # The audit chain the claims extended still verifies.
    assert await store.verify_audit_chain(run["id"])


def _overlap(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["target_key"] == b["target_key"]:
        return True
    if a["target_scope"] is None or a["target_scope"] != b["target_scope"]:
        return False
    return bool(a["target_namespace_wide"] or b["target_namespace_wide"])


@pytest.mark.timeout(600)
async def test_many_claimers_on_overlapping_targets_never_overlap_and_tokens_rise(store) -> None:
    """Twelve runs; two namespaces, each with a wide write and specific keys
    claimed by several writes each; every round all waiting writes claim at
    once while the previous round's holders record their results."""
    rng = random.Random(12)  # noqa: S311 (a reproducible shuffle, not a secret)
    runs = [await new_run(store) for _ in range(12)]
    actions: list[dict[str, Any]] = []
    for namespace in ("ns-a", "ns-b"):
        for copy in range(2):
            fields = target_fields(WIDE, namespace=namespace)
            actions.append(
                await new_action(store, rng.choice(runs), key=f"{namespace}-wide-{copy}", **fields)
            )
        for key in range(4):
            for copy in range(3):
                fields = target_fields(f"task-{key}", namespace=namespace)
                actions.append(
                    await new_action(
                        store, rng.choice(runs), key=f"{namespace}-{key}-{copy}", **fields
                    )
                )
    by_id = {a["id"]: a for a in actions}
    waiting = [a["id"] for a in actions]
    holding: list[str] = []
    top_token: dict[str, int] = {}  # per scope: the largest token granted so far
    key_tokens: dict[str, list[int]] = {}
    rounds = 0
    while waiting or holding:
        rounds += 1
        assert rounds < 200, "no progress"
        rng.shuffle(waiting)
        releasing = list(holding)
        calls = [store.claim_action_for_execution(a, lease_seconds=60) for a in waiting]
        calls += [store.record_action_terminal_result(a, "succeeded", {}) for a in releasing]
        results = await asyncio.gather(*calls)
        outcomes = dict(zip(waiting, results[: len(waiting)], strict=True))
        assert all(results[len(waiting) :]), "a holder could not record its result"
        assert set(outcomes.values()) <= {"claimed", "target_busy"}, outcomes
        winners = [a for a, o in outcomes.items() if o == "claimed"]

        # Never two live leases on overlapping targets: what holds now is
        # exactly this round's winners, and they are pairwise apart.
        async with store.session_factory() as session:
            leased = set((await session.execute(select(ActionLeaseRow.action_id))).scalars())
            executing = set(
                (
                    await session.execute(
                        select(ActionRow.id).where(ActionRow.status == "executing")
                    )
                ).scalars()
            )
        assert leased == executing == set(winners)
        for i, first in enumerate(winners):
            for second in winners[i + 1 :]:
                assert not _overlap(by_id[first], by_id[second]), (first, second)

        # Tokens: every grant in a scope outranks every earlier grant in it
        # (and so on its key); grants of one round in one scope are distinct.
        granted: dict[str, list[int]] = {}
        for winner in winners:
            row = await store.get_action(winner)
            assert row["attempt_count"] == 1
            granted.setdefault(row["target_scope"], []).append(row["fencing_token"])
            key_tokens.setdefault(row["target_key"], []).append(row["fencing_token"])
        for scope, tokens in granted.items():
            assert len(set(tokens)) == len(tokens), tokens
            assert min(tokens) > top_token.get(scope, 0), (scope, tokens, top_token)
            top_token[scope] = max(tokens)
        waiting = [a for a in waiting if a not in winners]
        holding = winners
    for tokens in key_tokens.values():
        assert tokens == sorted(set(tokens))
    assert sum(len(t) for t in key_tokens.values()) == len(actions)
    for run in runs:
        assert await store.verify_audit_chain(run["id"])


# A hold or renewal: one UPDATE … RETURNING; on SQLite, BEGIN IMMEDIATE and a
# statement that takes the write lock before the clock is read (sent in one
# trip), so a lease that lapsed while the hold waited for another process's
# lock is judged by the clock after the wait (tests/test_store_leases.py).
HOLD = {"postgresql": 1, "sqlite": 3}
# A definite result (roundtable/store/outcome.py): lock the run, read the
# action and the run's head with the clock, the action, the lease, the event,
# the chain head. On SQLite, BEGIN IMMEDIATE instead of the lock (sent with
# the read); its clock, this process's, needs no statement.
RESULT = {"postgresql": 6, "sqlite": 6}


async def test_a_hold_is_one_statement_and_a_result_reads_the_clock_with_the_action(
    store,
) -> None:
    dialect = store.engine.dialect.name
    run = await new_run(store)
    action = await new_action(store, run, key="held", **target_fields("held"))
    claim = await store.claim_for_execution(action["id"], 30)
    token = claim.action["fencing_token"]

    with counting(store) as seen:
        assert await store.hold_action_lease(action["id"], token, 30) == "executing"
    assert len(seen) == HOLD[dialect], seen
    with counting(store) as seen:
        assert await store.renew_action_lease(action["id"], token, 30)
    assert len(seen) == HOLD[dialect], seen
    with counting(store) as seen:
        assert await store.hold_action_lease(action["id"], token + 1, 30) is None
    assert len(seen) == HOLD[dialect], seen

    with counting(store) as seen:
        assert await store.record_action_terminal_result(
            action["id"], "succeeded", {"ok": True}, fencing_token=token
        )
    assert len(seen) == RESULT[dialect], seen
    # Once the lease is gone, neither holds.
    assert await store.hold_action_lease(action["id"], token, 30) is None
    assert not await store.renew_action_lease(action["id"], token, 30)
    assert await store.verify_audit_chain(run["id"])


async def test_a_claim_refuses_a_snapshot_taken_before_its_locks(postgres_url) -> None:
    """PostgreSQL: the claim's checks are safe because its second statement
    reads a snapshot taken after its first statement's locks, which READ
    COMMITTED gives. The claim's transaction pins it (tests/
    test_core_claim_attacks.py); a transaction at another level reaching the
    statements anyway is refused, not trusted."""
    from datetime import timedelta

    from roundtable.store import ConflictError, open_store
    from roundtable.store.leases import _claim_postgresql

    async with open_store(postgres_url) as store:
        run = await new_run(store)
        action = await new_action(store, run, key="rr", **target_fields("rr"))
        snapshot = store.engine.execution_options(isolation_level="REPEATABLE READ")
        async with snapshot.begin() as connection:
            with pytest.raises(ConflictError, match="READ COMMITTED"):
                await _claim_postgresql(connection, action["id"], timedelta(seconds=30))
        assert (await store.get_action(action["id"]))["status"] == "approved"


@pytest.mark.timeout(600)
async def test_claimers_of_one_key_racing_its_release_get_rising_tokens(store) -> None:
    """A key without a scope: only its own counter row orders its tokens.
    Each round every waiting write claims while the holder records its
    result, so a claim may find the lease gone mid-way."""
    from tests.helpers import target_for

    target = target_for("contended")
    runs = [await new_run(store) for _ in range(8)]
    waiting = [
        (await new_action(store, runs[i % 8], key=f"one-key-{i}", target_key=target))["id"]
        for i in range(16)
    ]
    holder: str | None = None
    tokens: list[int] = []
    while waiting or holder:
        calls = [store.claim_action_for_execution(a, lease_seconds=60) for a in waiting]
        if holder is not None:
            calls.append(store.record_action_terminal_result(holder, "succeeded", {}))
        results = await asyncio.gather(*calls)
        outcomes = dict(zip(waiting, results[: len(waiting)], strict=True))
        winners = [a for a, o in outcomes.items() if o == "claimed"]
        assert len(winners) <= 1, outcomes
        async with store.session_factory() as session:
            leased = list((await session.execute(select(ActionLeaseRow.action_id))).scalars())
        assert leased == winners
        if winners:
            token = (await store.get_action(winners[0]))["fencing_token"]
            assert not tokens or token > tokens[-1], (tokens, token)
            tokens.append(token)
            waiting.remove(winners[0])
        holder = winners[0] if winners else None
    assert len(tokens) == 16


@pytest.mark.parametrize("scoped", [True, False])
async def test_a_claims_locks_hold_off_every_claimer_that_could_overlap(store, scoped) -> None:
    """What the claim's safety rests on, tested directly: while one claim is
    between its locks and its commit, a claim of the same key (and, with a
    scope, a namespace-wide claim of the scope) waits; on PostgreSQL a claim
    elsewhere does not. (A slow machine can only make this pass for a broken
    lock, never fail for a working one.)"""
    from roundtable.store import leases

    postgresql = store.engine.dialect.name == "postgresql"
    runs = [await new_run(store) for _ in range(4)]  # different runs: the run lock is not it

    def fields(name: object, namespace: str = "lease-test") -> dict[str, Any]:
        got = target_fields(name, namespace=namespace)
        return got if scoped else {"target_key": got["target_key"]}

    # The key's (and scope's) counter rows exist already, as on any key used before.
    before = await new_action(store, runs[0], key="before", **fields("locked"))
    assert await store.claim_action_for_execution(before["id"], 30) == "claimed"
    assert await store.record_action_terminal_result(before["id"], "succeeded", {})
    first = await new_action(store, runs[0], key="first", **fields("locked"))
    rivals = [await new_action(store, runs[1], key="same-key", **fields("locked"))]
    if scoped:
        rivals.append(await new_action(store, runs[2], key="wide", **fields(WIDE)))
    elsewhere = await new_action(store, runs[3], key="away", **fields("free", namespace="away"))

    lock = leases._lock_statement() if postgresql else leases._facts_query(with_counters=True)
    async with store.db.transaction() as session:
        assert (await session.execute(lock, {"claim_action_id": first["id"]})).one()
        waiting = [
            asyncio.create_task(store.claim_action_for_execution(r["id"], 30)) for r in rivals
        ]
        if postgresql:  # SQLite's write lock is one for the whole database
            assert await store.claim_action_for_execution(elsewhere["id"], 30) == "claimed"
        done, _ = await asyncio.wait(waiting, timeout=2)
        assert not done, [t.result() for t in done]
    outcomes = sorted(await asyncio.gather(*waiting))
    assert outcomes == ["claimed"] + ["target_busy"] * (len(rivals) - 1)
