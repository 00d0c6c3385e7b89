"""Reconciliation requests under adversarial review (of 6c5ff00, 2026-12-08):
four findings, each failing before its fix, and the attacks that held.

1. A lost answer retried past the attestation's ten minutes was refused as
   stale: now its own record is its answer (_reconciled_despite_age).
2. A refusal for time that could not be kept failed the activity, which
   Temporal retried, and the retry after the lease ran out took the request:
   now the refusal is the answer whether kept or not, and a request asked
   while the attempt could run is refused for ever (asked_at).
3. The store path's lost answer (its worker frozen after the commit) was a
   409: now operations.reconcile finds the request's record.
4. The routed lookup compared request and person, not the outcome, and
   looked up a copy whose attestation was broken: now neither."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import update
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

import activities.write_activities as write_activities_module
from roundtable.store.schema import ActionLeaseRow
from tests.test_reconcile_requests import (
    _asked,
    _CommitsThenHangs,
    _events,
    asked_twice,
    unknown_claimed_write,
)


class _Later(datetime):
    """The activity's clock, eleven minutes on (a worker replaced, a
    database starved: the retry lands past the attestation's ten minutes)."""

    @classmethod
    def now(cls, tz: Any = None) -> datetime:  # type: ignore[override]
        return datetime.now(tz) + timedelta(minutes=11)


# ------------------------------------------------------------------ 1. a lost answer, retried late


@pytest.mark.parametrize("outcome", ["succeeded", "failed"])
async def test_a_lost_answer_retried_past_the_attestations_age_is_still_its_own(
    tmp_path, monkeypatch, outcome: str
) -> None:
    """A request whose answer was lost after COMMIT is found again and told
    as the caller's own, also when its retry comes past the attestation's
    ten minutes (the run's worker replaced, the database starved), as the
    decision and extension paths do (_recorded_despite_age)."""
    async with unknown_claimed_write(tmp_path) as made:
        store, _registry, action, writes = made
        await asyncio.sleep(2.2)  # the attempt's lease has run out
        asked = _asked(action["id"], outcome)

        # Attempt 1 commits; the connection drops after COMMIT, and the
        # database is still unreachable for its own lookup.
        real_reconcile = store.reconcile_action

        async def commits_then_drops(*args: Any, **kwargs: Any) -> Any:
            await real_reconcile(*args, **kwargs)
            raise ConnectionResetError("server closed the connection after COMMIT")

        async def unreachable(*args: Any, **kwargs: Any) -> Any:
            raise ConnectionRefusedError("database unreachable")

        store.reconcile_action = commits_then_drops
        store.reconciled_by_request = unreachable
        try:
            with pytest.raises(Exception) as first:
                await ActivityEnvironment().run(writes.reconcile_action, asked)
        finally:
            del store.reconcile_action, store.reconciled_by_request
        # A retryable failure: Temporal tries the activity again.
        assert not (isinstance(first.value, ApplicationError) and first.value.non_retryable), (
            first.value
        )
        monkeypatch.setattr(write_activities_module, "datetime", _Later)

        # Attempt 2 of the same request, past the attestation's age.
        try:
            retried: Any = await ActivityEnvironment().run(writes.reconcile_action, asked)
        except ApplicationError as exc:
            retried = exc
        stands = await store.get_action(action["id"])
    assert stands["status"] == outcome and stands["result"]["reconciled_by"] == "op-1"
    assert not isinstance(retried, Exception), (
        f"op-1's reconciliation stands in the store, but the retry of their own request "
        f"was answered {type(retried).__name__}({retried}) [{getattr(retried, 'type', '')}]"
    )
    assert retried.conflict is None and retried.status == outcome, retried


# ------------------------------------------------------------------ 4. the routed lookup


async def test_the_routed_lookup_does_not_tell_a_forged_copy_its_outcome_stands(
    tmp_path,
) -> None:
    """reconciled_by_request (the routed fallback) compared the request id
    and the person only: a copy of op-1's 'failed' request with its outcome
    rewritten to 'succeeded' (its attestation no longer verifies) was told
    'failed', no conflict, as if the request stood."""
    async with unknown_claimed_write(tmp_path) as made:
        _store, _registry, action, writes = made
        await asyncio.sleep(2.2)
        asked = _asked(action["id"], "failed")
        done = await ActivityEnvironment().run(writes.reconcile_action, asked)
        assert done.conflict is None and done.status == "failed"
        forged = asked.model_copy(update={"outcome": "succeeded"})
        seen = await ActivityEnvironment().run(writes.reconciled_by_request, forged)
        # The same request, its attestation stripped or its note changed:
        # nobody vouches for it, so nobody's record is its answer.
        for copy in ({"attested_by": None}, {"note": "mine now"}):
            unvouched = asked.model_copy(update=copy)
            told = await ActivityEnvironment().run(writes.reconciled_by_request, unvouched)
            assert told.conflict is not None, (copy, told)
    assert seen.conflict is not None, (
        f"a copy asking 'succeeded' (MAC broken) was answered {seen.status!r} with no "
        "conflict, as its own request's"
    )


# ------------------------------------------------------------------ 2. a refusal not kept


@pytest.mark.parametrize("outcome", ["succeeded", "failed"])
async def test_a_refusal_that_could_not_be_kept_is_not_taken_by_the_retry(
    tmp_path, monkeypatch, outcome: str
) -> None:
    """A request refused for time is never taken later, even when keeping
    its refusal fails (SQLite busy, a dropped connection). That used to
    fail the activity, which the run's update retries as a local activity:
    the retry after the lease ran out took the very request, in the
    operator's name, from a word given while the attempt could still run."""
    async with unknown_claimed_write(tmp_path) as made:
        store, _registry, action, writes = made
        asked = _asked(action["id"], outcome)

        async def busy(*args: Any, **kwargs: Any) -> Any:
            raise TimeoutError("database is locked")

        store.refuse_reconcile = busy
        try:
            first: Any = await ActivityEnvironment().run(writes.reconcile_action, asked)
        except Exception as exc:
            first = exc
        finally:
            del store.refuse_reconcile
        # What Temporal does with that failure:
        retried_by_temporal = not (
            isinstance(first, ApplicationError) and first.non_retryable
        ) and not (not isinstance(first, Exception) and first.retry_at is not None)
        await asyncio.sleep(2.2)  # the lease has run out; Temporal's retry comes
        second = await ActivityEnvironment().run(writes.reconcile_action, asked)
        stands = await store.get_action(action["id"])
    # The refusal is the answer, kept or not: nothing for Temporal to retry.
    assert not retried_by_temporal, first
    # The same request again after the lease ran out (a retry, a copy): refused.
    assert stands["status"] == "unknown" and second.conflict is not None, (
        f"attempt 1 was refused for time ({first!r}); the same request, sent again "
        f"after the lease ran out, was taken: {second!r}, the action now "
        f"{stands['status']} by {stands['result'].get('reconciled_by')}"
    )


async def test_the_runs_update_never_takes_a_request_refused_for_time_after_its_lease_ran_out(
    tmp_path, monkeypatch
) -> None:
    """Finding 2 end to end, through the run's workflow (the path the API and
    CLI take first). The action is unknown and its attempt's lease still runs
    (a worker that lost its heartbeat: the lease is not out yet). Operator
    op-1 asks 'succeeded'; the store refuses it for time, and keeping the
    refusal fails while the database is unavailable for a few seconds. The
    update's local activity used to be retried, and the retry after the
    lease ran out took the very request that was refused."""
    import time

    from roundtable import operations
    from tests.test_closed_runs import answer_lost, unknown_update
    from tests.workflow_harness import harness

    async with harness(tmp_path, customize=answer_lost) as h:
        handle, action_id = await unknown_update(h)
        # The attempt could still be running for 3 s more.
        async with h.store.db.transaction() as session:
            await session.execute(
                update(ActionLeaseRow)
                .where(ActionLeaseRow.action_id == action_id)
                .values(lease_expires_at=datetime.now(UTC) + timedelta(seconds=3))
            )
        real = h.store.refuse_reconcile
        until = time.monotonic() + 3.5  # the database refuses writes meanwhile
        tried: list[int] = []

        async def unavailable(*args: Any, **kwargs: Any) -> Any:
            tried.append(1)
            if time.monotonic() < until:
                raise ConnectionResetError("the database is failing over")
            return await real(*args, **kwargs)

        monkeypatch.setattr(h.store, "refuse_reconcile", unavailable)
        try:
            told: Any = await operations.reconcile(
                h.client, h.store, action_id, "succeeded", "op-1", "seen", h.task_queue
            )
        except Exception as exc:
            told = exc
        stands = await h.store.get_action(action_id)
        refused = await _events(h.store, handle.id, "action.reconcile_refused")
        await handle.terminate(reason="test done")
    assert tried, "the store never refused the request for time"
    assert stands["status"] == "unknown", (
        f"op-1's request was refused for time ({len(tried)} refusal(s) not kept: {refused}), "
        f"then taken by Temporal's retry: told {told!r}; the action is now "
        f"{stands['status']} by {stands['result'].get('reconciled_by')}"
    )


# ------------------------------------------------------------------ held


@pytest.mark.parametrize(
    "change",
    [{"request_id": "other"}, {"decided_by": "op-2"}, {"outcome": "failed"}, {"note": "x"}],
)
async def test_held_a_copy_with_any_field_changed_is_not_an_operators(tmp_path, change) -> None:
    async with unknown_claimed_write(tmp_path) as made:
        store, _registry, action, writes = made
        copied = _asked(action["id"]).model_copy(update=change)
        with pytest.raises(ApplicationError) as refused:
            await ActivityEnvironment().run(writes.reconcile_action, copied)
        still = await store.get_action(action["id"])
    assert refused.value.type.startswith("Forbidden"), refused.value
    assert still["status"] == "unknown"


async def test_held_one_request_racing_its_own_refusal_and_reconciliation(store) -> None:
    """The same request's reconciliation and its refusal for time, at once,
    many times over: one answer each, never both, on both databases."""
    from tests.helpers import new_action, new_run, target_for

    for i in range(8):
        run = await new_run(store)
        action = await new_action(store, run, key=f"u{i}", target_key=target_for(f"u{i}"))
        assert await store.claim_action_for_execution(action["id"], 30) == "claimed"
        token = (await store.get_action(action["id"]))["fencing_token"]
        assert await store.record_action_terminal_result(
            action["id"], "unknown", {"error_code": "x"}, fencing_token=token, attempt_over=True
        )
        results = await asyncio.gather(
            store.reconcile_action(action["id"], "succeeded", "op-1", "n", request_id="r"),
            store.refuse_reconcile(action["id"], "r", "op-1", "succeeded", datetime.now(UTC)),
            store.reconcile_action(action["id"], "succeeded", "op-1", "n", request_id="r"),
            return_exceptions=True,
        )
        kinds = [
            e["event_type"]
            for e in await store.list_events(run["id"])
            if e["event_type"] in ("action.reconciled", "action.reconcile_refused")
        ]
        stands = await store.get_action(action["id"])
        assert len(kinds) == 1, (kinds, results)
        if kinds == ["action.reconciled"]:
            assert stands["status"] == "succeeded"
            assert all(not isinstance(r, Exception) for r in results), results
        else:
            assert stands["status"] == "unknown"
            assert all(isinstance(r, Exception) for r in (results[0], results[2])), results


# ------------------------------------------------------------------ 3. the store path


async def test_the_store_paths_lost_answer_is_told_as_its_own(tmp_path) -> None:
    """The store path (the run's workflow is closed: the API and CLI go
    through ReconcileWorkflow, here to the tool worker). Its activity runs
    once; a reconciliation that committed on a worker that then froze was
    told 409 (the activity's timeout, as a 'conflict'), and asked again
    'not unknown'. operations.reconcile now looks for the request's record."""
    from tests.test_worker_roles import tool_worker, unknown_routed_write, workflows_only
    from tests.workflow_harness import harness

    async with harness(tmp_path, worker_factory=workflows_only) as h:
        handle, action_id = await unknown_routed_write(h)
        await handle.terminate(reason="stuck, said the on-call")
        async with tool_worker(h, store=_CommitsThenHangs(h.store)):
            answers = await asked_twice(h, action_id)
        stands = await h.store.get_action(action_id)
    assert stands["status"] == "succeeded" and stands["result"]["reconciled_by"] == "op-1"
    assert isinstance(answers[0], dict) and answers[0]["status"] == "succeeded", (
        f"op-1's reconciliation stands, but op-1 was told {answers[0]!r}, then {answers[1]!r}"
    )
