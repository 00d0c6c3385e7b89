"""A reconciliation request is answered once, and only as its own
(roundtable/store/reconcile_requests.py). Found in the review of 2026-12-07,
where each was a strict xfail:

1. Routed (worker roles): a reconciliation whose activity found no tool
   worker was answered with the store's status whenever it equalled the
   outcome asked for, whoever recorded it: operator B was told "succeeded"
   while the store and the audit log said operator A reconciled it.
2. A reconciliation that committed and whose answer was then lost (the
   connection dropped after COMMIT) was answered as a conflict, and asked
   again was 409 "not unknown": the operator whose word stands was never
   told so.
3. An operator's attested request that was refused (the attempt might still
   run) could be sent again unchanged within the attestation's ten minutes
   by anyone who read it in a history, and then stood in that operator's
   name.

Still open, with no test here (the wait is the finding): with no worker
polling the run's task queue, a reconciliation sent through the run's
workflow has no answer until a worker returns, and then lands in the
operator's name after the operator gave up (the store path is bounded by
RECONCILE_WITHIN; the update is not).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ActivityError, ApplicationError, RetryState, TimeoutType
from temporalio.exceptions import TimeoutError as TemporalTimeout
from temporalio.service import RPCError
from temporalio.testing import ActivityEnvironment

from activities.write_activities import WriteActivities
from roundtable import operations
from roundtable.client import RoundtableClient
from roundtable.models import ReconcileInput
from roundtable.names import INVALID_INPUT
from roundtable.store import ConflictError, open_store
from roundtable.tools.tickets import TicketSystem
from tests.helpers import new_action, new_run, target_for
from tests.test_closed_runs import answer_lost, unknown_update
from tests.test_fence import claimed_write
from tests.test_worker_roles import tool_worker, unknown_routed_write, workflows_only
from tests.workflow_harness import TRUSTING, as_operator, harness, shorten_bookkeeping


def _asked(action_id: str, outcome: str = "succeeded", by: str = "op-1") -> ReconcileInput:
    return as_operator(
        ReconcileInput(
            action_id=action_id,
            outcome=outcome,
            decided_by=by,
            note="looked at 10:02",
            request_id=uuid.uuid4().hex,
        )
    )


class UnknownWrite(NamedTuple):
    store: Any
    registry: Any
    action: dict[str, Any]
    writes: WriteActivities


@contextlib.asynccontextmanager
async def unknown_claimed_write(tmp_path: Any) -> AsyncIterator[UnknownWrite]:
    """A ticket update claimed under a 2 s lease, made unknown by recovery
    while that lease still runs, and the write activities over its store."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'rt.db'}"
    async with open_store(url) as store:
        tickets = await TicketSystem.open(url)
        try:
            registry, action, _, _, _ = await claimed_write(store, tickets)
            await store.recover_expired_action_leases(now=datetime.now(UTC) + timedelta(seconds=5))
            yield UnknownWrite(
                store, registry, action, WriteActivities(store, registry, authority=TRUSTING)
            )
        finally:
            await tickets.close()


async def asked_twice(h: Any, action_id: str) -> list[Any]:
    """op-1 reconciles as succeeded, then asks again: each answer, or its conflict."""
    answers: list[Any] = []
    for _ in range(2):
        try:
            answers.append(
                await operations.reconcile(
                    h.client, h.store, action_id, "succeeded", "op-1", "seen", h.task_queue
                )
            )
        except ConflictError as exc:
            answers.append(exc)
    return answers


def _counting_fences(registry: Any) -> list[int]:
    """ticket_update's fence, each call counted."""
    fences: list[int] = []
    tool = registry.get("ticket_update")

    async def counted(*args: Any) -> Any:
        fences.append(1)
        return await tool.fence(*args)

    registry.tools["ticket_update"] = dataclasses.replace(tool, fence=counted)
    return fences


async def _events(store: Any, run_id: str, *types: str) -> list[dict[str, Any]]:
    return [e["payload"] for e in await store.list_events(run_id) if e["event_type"] in types]


# ------------------------------------------------------------------ 1. routed


async def test_a_routed_reconciliation_is_never_told_another_operators_verdict(tmp_path) -> None:
    async with harness(tmp_path, worker_factory=workflows_only) as h:
        handle, action_id = await unknown_routed_write(h)
        # The tool worker is gone (a deploy, a crash). Operator A settles the
        # action in the store (the reconciliation workflow's path; its nudge
        # to the run not in yet), then operator B, through the typed client,
        # asks for the same outcome.
        await h.store.reconcile_action(
            action_id, "succeeded", "op-A", "A read the ticket", request_id="a-1"
        )
        client = RoundtableClient(h.client, h.task_queue)
        told: Any
        try:
            told = await client.reconcile(
                handle.id, action_id, "succeeded", decided_by="op-B", note="B read it too"
            )
        except ConflictError as exc:
            told = exc
        action = await h.store.get_action(action_id)
        reconciled = await _events(h.store, handle.id, "action.reconciled")
        with contextlib.suppress(RPCError):  # the run may have ended, told of A's
            await handle.terminate(reason="test done")
    assert action["result"]["reconciled_by"] == "op-A"
    assert [r["decided_by"] for r in reconciled] == ["op-A"]
    # B's request recorded nothing: B must not be told it reconciled the action.
    assert isinstance(told, ConflictError), (
        f"op-B was answered {told!r} as if their reconciliation stood, but the store "
        f"records op-A ({action['result']['reconciliation_note']!r}) and nothing of op-B"
    )


class _CommitsThenHangs:
    """A tool worker's store whose reconciliation commits, then never
    answers (the worker frozen, then gone): its activity times out."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def reconcile_action(self, *args: Any, **kwargs: Any) -> Any:
        await self._store.reconcile_action(*args, **kwargs)
        await asyncio.sleep(3600)


class _Committing:
    """What _CommitsThenHangs wraps: just the real reconciliation."""

    def __init__(self, reconcile: Any) -> None:
        self.reconcile_action = reconcile


async def test_a_routed_reconciliation_that_committed_on_a_tool_worker_gone_since_is_its_own(
    tmp_path, monkeypatch
) -> None:
    """The run's own request, recorded by a tool worker that then timed out:
    the run asks the store for this request's record, and answers with it."""
    shorten_bookkeeping(monkeypatch)
    async with harness(tmp_path, worker_factory=workflows_only) as h:
        handle, action_id = await unknown_routed_write(h)
        async with tool_worker(h, store=_CommitsThenHangs(h.store)):
            with h.env.auto_time_skipping_disabled():
                told = await RoundtableClient(h.client, h.task_queue).reconcile(
                    handle.id, action_id, "succeeded", decided_by="op-1", note="seen"
                )
            reconciled = await _events(h.store, handle.id, "action.reconciled")
            assert (await handle.result()).status == "completed"
    assert told == "succeeded"
    assert [r["decided_by"] for r in reconciled] == ["op-1"]


# ------------------------------------------------------------------ 2. answer lost


@pytest.mark.parametrize("workflow", ["open", "terminated"])
async def test_a_reconciliation_whose_answer_was_lost_after_commit_is_answered_as_its_own(
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
        answers = await asked_twice(h, action_id)
        action = await h.store.get_action(action_id)
        if workflow == "open":
            assert (await handle.result()).status == "completed"
    assert dropped, "the fault was never injected"
    assert action["status"] == "succeeded" and action["result"]["reconciled_by"] == "op-1"
    # The first request committed: its answer says so. The second is a new
    # request, refused plainly (the action is no longer unknown).
    assert isinstance(answers[0], dict) and answers[0]["status"] == "succeeded", answers
    assert isinstance(answers[1], ConflictError) and "not unknown" in str(answers[1]), answers


async def test_a_reconciliation_whose_worker_never_answered_after_commit_is_answered_as_its_own(
    tmp_path, monkeypatch
) -> None:
    """The store path: the reconciliation's activity committed, then never
    answered (its worker frozen, then gone), and timed out. The operator is
    told it stood, not "Workflow execution failed"."""
    async with harness(tmp_path, customize=answer_lost) as h:
        handle, action_id = await unknown_update(h)
        await handle.terminate(reason="stuck, said the on-call")
        hangs = _CommitsThenHangs(_Committing(h.store.reconcile_action))
        monkeypatch.setattr(h.store, "reconcile_action", hangs.reconcile_action)
        done = await operations.reconcile(
            h.client, h.store, action_id, "succeeded", "op-1", "seen", h.task_queue
        )
        action = await h.store.get_action(action_id)
    assert done["status"] == "succeeded" and done["via"] == "store", done
    assert action["result"]["reconciled_by"] == "op-1"


async def test_an_update_whose_answer_was_lost_on_the_wire_is_answered_as_its_own(
    tmp_path, monkeypatch
) -> None:
    """The run's workflow reconciled it; the connection to Temporal dropped
    before its answer came back."""
    async with harness(tmp_path, customize=answer_lost) as h:
        handle, action_id = await unknown_update(h)
        real = operations.send_update

        async def answered_then_dropped(*args: Any, **kwargs: Any) -> Any:
            await real(*args, **kwargs)
            raise operations.TemporalUnavailableError("Temporal is unavailable: connection reset")

        monkeypatch.setattr(operations, "send_update", answered_then_dropped)
        done = await operations.reconcile(
            h.client, h.store, action_id, "succeeded", "op-1", "seen", h.task_queue
        )
        assert (await handle.result()).status == "completed"
    assert done["status"] == "succeeded" and done["via"] == "workflow", done


def test_a_store_path_whose_activity_timed_out_says_it_may_have_been_recorded() -> None:
    """Told "Workflow execution failed" (a 409 that says another request
    decided first) before: the timeout sits under the activity's error."""
    lost = ActivityError(
        "Activity task timed out",
        scheduled_event_id=5,
        started_event_id=6,
        identity="worker-1",
        activity_type="reconcile_for_run",
        activity_id="1",
        retry_state=RetryState.TIMEOUT,
    )
    lost.__cause__ = TemporalTimeout(
        "activity StartToClose timeout",
        type=TimeoutType.START_TO_CLOSE,
        last_heartbeat_details=[],
    )
    told = operations._store_error(WorkflowFailureError(cause=lost))
    assert isinstance(told, operations.TemporalUnavailableError)
    assert "may still have been recorded" in str(told)


# ------------------------------------------------------------------ no worker


async def _update_outcomes(handle: Any, within: float = 60) -> list[Any]:
    """The run's completed updates' outcomes, once one has completed."""
    for _ in range(int(within * 10)):
        done = [
            event.workflow_execution_update_completed_event_attributes.outcome
            async for event in handle.fetch_history_events()
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_COMPLETED
        ]
        if done:
            return done
        await asyncio.sleep(0.1)
    raise AssertionError("no update completed")


async def test_a_reconciliation_no_worker_took_in_time_is_never_recorded_later(
    tmp_path, monkeypatch
) -> None:
    """No worker polls the run's queue: the operator is told, once the
    request's deadline is past, that nothing was recorded. A worker that
    comes back afterwards and takes the update refuses it as late: the
    action stays unknown, and nothing stands in the operator's name."""
    monkeypatch.setattr(operations, "RECONCILE_WITHIN", timedelta(seconds=2))
    monkeypatch.setattr(operations, "LATE_GRACE", timedelta(seconds=1))
    # The dev server: the test server keeps no update its caller gave up on.
    async with harness(tmp_path, customize=answer_lost, dev_server=True) as h:
        handle, action_id = await unknown_update(h)
        await h.stop_worker()
        with pytest.raises(operations.TemporalUnavailableError) as told:
            await operations.reconcile(
                h.client, h.store, action_id, "succeeded", "op-1", "seen", h.task_queue
            )
        await h.start_worker()
        outcomes = await _update_outcomes(handle)
        refusal = await h.client.data_converter.decode_failure(outcomes[0].failure)
        action = await h.store.get_action(action_id)
        reconciled = await _events(h.store, handle.id, "action.reconciled")
        state = await h.state(handle)
        await handle.terminate(reason="test done")
    assert "nothing was recorded" in str(told.value), told.value
    assert [o.HasField("failure") for o in outcomes] == [True], outcomes
    assert "no worker took it by then" in str(refusal), refusal
    assert action["status"] == "unknown" and reconciled == []
    assert action_id in state.unknown_actions


# ------------------------------------------------------------------ 3. refused, sent again


@pytest.mark.parametrize("outcome", ["succeeded", "failed"])
async def test_a_refused_reconciliation_sent_again_later_is_not_taken(
    tmp_path, outcome: str
) -> None:
    """ "failed" is refused before its fence (the tool is never asked to
    fence for a request refused before); "succeeded" in the store."""
    async with unknown_claimed_write(tmp_path) as made:
        store, registry, action, writes = made
        fences = _counting_fences(registry)
        asked = _asked(action["id"], outcome)
        first = await ActivityEnvironment().run(writes.reconcile_action, asked)
        assert first.retry_at is not None, first  # refused: the attempt may still run

        await asyncio.sleep(2.2)  # the lease has run out; the operator has not asked again
        replayed = await ActivityEnvironment().run(writes.reconcile_action, asked)
        still = await store.get_action(action["id"])
        refused = await _events(store, action["run_id"], "action.reconcile_refused")
        # The operator asks anew (a new request, a new attestation): taken.
        anew = await ActivityEnvironment().run(
            writes.reconcile_action, _asked(action["id"], outcome)
        )
    assert replayed.conflict is not None and "refused at" in replayed.conflict, replayed
    assert still["status"] == "unknown", still
    assert [(r["decided_by"], r["outcome"]) for r in refused] == [("op-1", outcome)]
    assert anew.conflict is None and anew.status == outcome, anew
    # Fenced once, for the new request only.
    assert fences == ([1] if outcome == "failed" else [])


@pytest.mark.parametrize("outcome", ["succeeded", "failed"])
async def test_an_attempt_sent_again_after_its_request_committed_is_answered_as_its_own(
    tmp_path, outcome: str
) -> None:
    """An activity retried, or the same update again, after the first
    attempt committed: answered with what stands, the tool not fenced again
    ("failed" finds the action settled before its fence, "succeeded" in the
    store's transaction)."""
    async with unknown_claimed_write(tmp_path) as made:
        store, registry, action, writes = made
        fences = _counting_fences(registry)
        await asyncio.sleep(2.2)  # the attempt's lease has run out
        asked = _asked(action["id"], outcome)
        answers = [await ActivityEnvironment().run(writes.reconcile_action, asked)]
        answers.append(await ActivityEnvironment().run(writes.reconcile_action, asked))
        other = await ActivityEnvironment().run(
            writes.reconcile_action, _asked(action["id"], outcome)
        )
        reconciled = await _events(store, action["run_id"], "action.reconciled")
    assert [(a.status, a.conflict) for a in answers] == [(outcome, None)] * 2, answers
    assert len(reconciled) == 1
    assert fences == ([1] if outcome == "failed" else [])
    # Another request is not this one: refused, as ever.
    assert other.conflict is not None and "only unknown actions" in other.conflict, other


async def test_a_reconciliation_that_names_no_request_is_refused(tmp_path) -> None:
    async with unknown_claimed_write(tmp_path) as made:
        store, _registry, action, writes = made
        unnamed = as_operator(
            ReconcileInput(action_id=action["id"], outcome="succeeded", decided_by="op-1", note="x")
        )
        with pytest.raises(ApplicationError) as refused:
            await ActivityEnvironment().run(writes.reconcile_action, unnamed)
        still = await store.get_action(action["id"])
    assert refused.value.type == INVALID_INPUT and "request_id" in str(refused.value)
    assert still["status"] == "unknown"


# ------------------------------------------------------------------ the store's rules


async def _unknown(store: Any) -> dict[str, Any]:
    """An unknown action whose attempt is over (no lease left running)."""
    run = await new_run(store)
    action = await new_action(store, run, key="u", target_key=target_for("u"))
    assert await store.claim_action_for_execution(action["id"], 30) == "claimed"
    token = (await store.get_action(action["id"]))["fencing_token"]
    assert await store.record_action_terminal_result(
        action["id"], "unknown", {"error_code": "x"}, fencing_token=token, attempt_over=True
    )
    return action


async def test_the_store_takes_a_request_once_and_only_as_its_own(store) -> None:
    action = await _unknown(store)
    action_id, run_id = action["id"], action["run_id"]
    first = await store.reconcile_action(action_id, "succeeded", "op-1", "seen", request_id="r-1")
    # The same request again (its answer lost): answered as it stands.
    again = await store.reconcile_action(action_id, "succeeded", "op-1", "seen", request_id="r-1")
    assert first["status"] == again["status"] == "succeeded"
    # Its id under another name or outcome is not this request's.
    with pytest.raises(ConflictError, match="another person or outcome"):
        await store.reconcile_action(action_id, "succeeded", "op-2", "me too", request_id="r-1")
    with pytest.raises(ConflictError, match="another person or outcome"):
        await store.reconcile_action(action_id, "failed", "op-1", "seen", request_id="r-1")
    # Another request is refused as ever: the action is settled.
    with pytest.raises(ConflictError, match="only unknown actions reconcile"):
        await store.reconcile_action(action_id, "succeeded", "op-1", "seen", request_id="r-2")
    assert (await store.reconciled_by_request(action_id, "r-1", "op-1", "succeeded"))[
        "status"
    ] == "succeeded"
    assert await store.reconciled_by_request(action_id, "r-1", "op-2", "succeeded") is None
    assert await store.reconciled_by_request(action_id, "r-1", "op-1", "failed") is None
    assert await store.reconciled_by_request(action_id, "r-2", "op-1", "succeeded") is None
    assert await store.reconciled_by_request(action_id, None, "op-1", "succeeded") is None
    # A refusal kept for a request that in fact stood keeps nothing: it stood.
    stood = await store.refuse_reconcile(action_id, "r-1", "op-1", "succeeded", datetime.now(UTC))
    assert stood is not None and stood["status"] == "succeeded"
    assert await _events(store, run_id, "action.reconcile_refused") == []
    assert len(await _events(store, run_id, "action.reconciled")) == 1


async def test_the_store_keeps_a_refusal_once_and_refuses_its_request_for_ever(store) -> None:
    action = await _unknown(store)
    action_id, run_id = action["id"], action["run_id"]
    retry_at = datetime.now(UTC)
    for _ in range(2):  # kept once, however often it is refused
        assert await store.refuse_reconcile(action_id, "r-1", "op-1", "succeeded", retry_at) is None
    (kept,) = await _events(store, run_id, "action.reconcile_refused")
    assert kept["decided_by"] == "op-1" and kept["retry_at"] == retry_at.isoformat()
    with pytest.raises(ConflictError, match="refused at"):
        await store.check_reconcilable(action_id, "r-1")
    with pytest.raises(ConflictError, match="refused at"):
        await store.reconcile_action(action_id, "succeeded", "op-1", "seen", request_id="r-1")
    assert (await store.get_action(action_id))["status"] == "unknown"
    # A request without an id, or another one, is not that request.
    assert (await store.check_reconcilable(action_id))["status"] == "unknown"
    done = await store.reconcile_action(action_id, "succeeded", "op-1", "seen", request_id="r-2")
    assert done["status"] == "succeeded"
