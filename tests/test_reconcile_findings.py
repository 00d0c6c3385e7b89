"""Reconciliation: findings of the review of 2026-12-07 not fixed yet, each
kept as a strict xfail (it fails the suite the day it passes, so its marker
must go with the fix). Fixed in the same review: a failing fence's text
(tests/test_reconcile_fence_failure.py) and a stalled run's unknown
(tests/test_reconcile_stalled.py).

1. Routed (worker roles): a reconciliation whose activity found no tool
   worker is answered with the store's status whenever it equals the
   outcome asked for, whoever recorded it: operator B is told "succeeded"
   while the store and the audit log say operator A reconciled it. The
   flaw DECISION_BY_REQUEST_PATCH fixed for decisions; the fix here needs
   a workflow patch of its own.
2. A reconciliation that committed and whose answer was then lost (the
   connection dropped after COMMIT, a worker gone after it) is answered as
   a conflict, and asked again is 409 "not unknown": the operator whose
   word stands is never told so. Reconciliation has no idempotency key,
   and the store keeps no request id to know a retry by.
3. An operator's attested request that was refused (the attempt may still
   run) can be sent again unchanged within the attestation's ten minutes by
   anyone who reads it in a history, and then stands in that operator's
   name: nothing records which request ids were answered.

Also found and not covered by a test here (the wait is the finding): with
no worker polling the run's task queue, a reconciliation sent through the
run's workflow has no answer until a worker returns, and then lands in the
operator's name after the operator gave up (the store path is bounded by
RECONCILE_WITHIN; the update is not).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from temporalio.testing import ActivityEnvironment

from activities.write_activities import WriteActivities
from roundtable import operations
from roundtable.client import RoundtableClient
from roundtable.models import ReconcileInput
from roundtable.store import ConflictError, open_store
from roundtable.tools.tickets import TicketSystem
from tests.test_closed_runs import answer_lost, unknown_update
from tests.test_fence import claimed_write
from tests.test_worker_roles import unknown_routed_write, workflows_only
from tests.workflow_harness import TRUSTING, as_operator, harness


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="FINDING (not fixed): 1")
async def test_not_fixed_a_routed_reconciliation_is_told_another_operators_verdict(
    tmp_path,
) -> None:
    async with harness(tmp_path, worker_factory=workflows_only) as h:
        handle, action_id = await unknown_routed_write(h)
        # The tool worker is gone (a deploy, a crash). Operator A settles the
        # action in the store (the reconciliation workflow's path; its nudge
        # to the run not in yet), then operator B, through the typed client,
        # asks for the same outcome.
        await h.store.reconcile_action(action_id, "succeeded", "op-A", "A read the ticket")
        client = RoundtableClient(h.client, h.task_queue)
        told: Any
        try:
            told = await client.reconcile(
                handle.id, action_id, "succeeded", decided_by="op-B", note="B read it too"
            )
        except ConflictError as exc:
            told = exc
        action = await h.store.get_action(action_id)
        reconciled = [
            e["payload"]
            for e in await h.store.list_events(handle.id)
            if e["event_type"] == "action.reconciled"
        ]
        await handle.terminate(reason="test done")
    assert action["result"]["reconciled_by"] == "op-A"
    assert [r["decided_by"] for r in reconciled] == ["op-A"]
    # B's request recorded nothing: B must not be told it reconciled the action.
    assert isinstance(told, ConflictError), (
        f"op-B was answered {told!r} as if their reconciliation stood, but the store "
        f"records op-A ({action['result']['reconciliation_note']!r}) and nothing of op-B"
    )


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="FINDING (not fixed): 2")
@pytest.mark.parametrize("workflow", ["open", "terminated"])
async def test_not_fixed_a_reconciliation_whose_answer_was_lost_after_commit_is_answered_as_its_own(
    tmp_path, monkeypatch, workflow: str
) -> None:
    async with harness(tmp_path, customize=answer_lost) as h:
        handle, action_id = await unknown_update(h)
        if workflow == "terminated":
            await handle.terminate(reason="stuck, said the on-call")

        real = h.store.reconcile_action
        dropped: list[bool] = []

        async def commits_then_the_connection_drops(*args: Any, **kwargs: Any) -> Any:
            done = await real(*args, **kwargs)
            if not dropped:
                dropped.append(True)
                raise ConnectionResetError("server closed the connection after COMMIT")
            return done

        monkeypatch.setattr(h.store, "reconcile_action", commits_then_the_connection_drops)
        answers: list[Any] = []
        for _ in range(2):  # the operator asks, then asks again
            try:
                answers.append(
                    await operations.reconcile(
                        h.client, h.store, action_id, "succeeded", "op-1", "seen", h.task_queue
                    )
                )
            except ConflictError as exc:
                answers.append(exc)
        action = await h.store.get_action(action_id)
        if workflow == "open":
            await handle.terminate(reason="test done")
    assert dropped, "the fault was never injected"
    assert action["status"] == "succeeded" and action["result"]["reconciled_by"] == "op-1"
    # op-1's reconciliation is the one that stands: one of the two answers at
    # least must say so, rather than a conflict both times.
    assert any(isinstance(a, dict) and a["status"] == "succeeded" for a in answers), (
        f"op-1's reconciliation committed, but op-1 was told {answers!r}"
    )


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="FINDING (not fixed): 3")
async def test_not_fixed_a_refused_reconciliation_sent_again_later_is_not_taken(tmp_path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'rt.db'}"
    async with open_store(url) as store:
        tickets = await TicketSystem.open(url)
        try:
            registry, action, _, _, _ = await claimed_write(store, tickets)
            # Recovery made it unknown while its lease (2 s) still runs.
            await store.recover_expired_action_leases(now=datetime.now(UTC) + timedelta(seconds=5))
            writes = WriteActivities(store, registry, authority=TRUSTING)
            asked = as_operator(
                ReconcileInput(
                    action_id=action["id"],
                    outcome="succeeded",
                    decided_by="op-1",
                    note="looked at 10:02",
                    request_id="op-1-request",
                )
            )
            first = await ActivityEnvironment().run(writes.reconcile_action, asked)
            assert first.retry_at is not None, first  # refused: the attempt may still run

            await asyncio.sleep(2.2)  # the lease has run out; the operator has not asked again
            replayed = await ActivityEnvironment().run(writes.reconcile_action, asked)
            settled = await store.get_action(action["id"])
        finally:
            await tickets.close()
    assert replayed.conflict is not None and settled["status"] == "unknown", (
        f"the refused request, sent again unchanged, reconciled the action as "
        f"{settled['status']} by {settled['result'].get('reconciled_by')!r}"
    )
