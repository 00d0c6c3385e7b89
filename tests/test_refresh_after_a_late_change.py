"""An operator's change (a decision, a reconciliation) made on a tool worker
tells its run when the run may have given up on it (from the review of
12c0581, 2026-12-07, third session).

The run gives up on a routed call at its start-to-close timeout, looks the
store up, finds nothing changed yet and refuses the operator; the call may
still commit after. Then only the activity can tell the run (a refresh): a
decision's run would wait to the approval's deadline, a reconciliation's
with no deadline at all. A refusal changed nothing and sends none, nor does
a change answered in time (a refresh wakes every wait of its run).

Unit level first (the activity in an ActivityEnvironment as a routed
attempt, the change itself stood in for, a client that records signals),
then end to end on the dev server with a real tool worker."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.write_activities import WriteActivities
from roundtable.completion import to_completion
from roundtable.models import (
    Decision,
    DecisionRecorded,
    ReconcileInput,
    ReconcileOutput,
    RecordDecisionInput,
)
from roundtable.names import DECIDE_UPDATE
from roundtable.permissions import Decider, TenantNotAllowedError, attest
from roundtable.security import ActionSecretKeyError
from tests.test_worker_roles import (
    lost_before_acting,
    publish,
    tool_worker,
    unknown_write,
    workflows_only,
)
from tests.test_worker_roles_failures import (
    _DiesAfterDeciding,
    _routed_write_waiting,
    signals_in,
)
from tests.test_workflow_execution import reconcile, wrap_tool
from tests.workflow_harness import harness, shorten_bookkeeping

DECIDED = DecisionRecorded(
    approval_id="ap-1",
    action_id="ac-1",
    status="approved",
    approval_status="approved",
    expires_at=datetime.now(UTC) + timedelta(hours=1),
)
RECONCILED = ReconcileOutput(action_id="ac-1", status="succeeded")


class _Signals:
    """A client that records the signals sent through it."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def get_workflow_handle(self, run_id: str) -> Any:
        sent = self.sent

        class _Handle:
            async def signal(self, name: str, *args: Any) -> None:
                sent.append(f"{run_id}:{name}")

        return _Handle()


class _Rows:
    async def get_approval(self, approval_id: str) -> dict[str, Any]:
        return {"id": approval_id, "run_id": "run-1"}

    async def get_action(self, action_id: str) -> dict[str, Any]:
        return {"id": action_id, "run_id": "run-1"}


def _routed(started_ago: float) -> ActivityEnvironment:
    """A routed attempt (30 s start-to-close) the server started
    ``started_ago`` seconds ago."""
    env = ActivityEnvironment()
    env.info = dataclasses.replace(
        env.info,
        is_local=False,
        start_to_close_timeout=timedelta(seconds=30),
        started_time=datetime.now(UTC) - timedelta(seconds=started_ago),
    )
    return env


async def _refreshes(kind: str, outcome: Any, started_ago: float = 0) -> list[str]:
    """The refreshes a routed ``kind`` (decide, reconcile) sends when its
    change ends in ``outcome`` (an answer, or an exception it raises)."""
    client = _Signals()
    writes = WriteActivities(_Rows(), None, client, authority=None)  # type: ignore[arg-type]

    async def change(_: Any) -> Any:
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    if kind == "decide":
        writes._decide = change  # type: ignore[method-assign]
        call, argument = (
            writes.decide_approval,
            RecordDecisionInput(
                decision=Decision(approval_id="ap-1", decision="approved", decided_by="op-1")
            ),
        )
    else:
        writes._reconcile = change  # type: ignore[method-assign]
        call, argument = (
            writes.reconcile_action,
            ReconcileInput(
                action_id="ac-1",
                outcome="succeeded",
                decided_by="op-1",
                note="checked",
                request_id="op-1-1",
            ),
        )
    raised = isinstance(outcome, BaseException)
    with pytest.raises(BaseException) if raised else contextlib.nullcontext():
        assert await _routed(started_ago).run(call, argument) == outcome
    if writes._telling:
        await asyncio.wait(set(writes._telling), timeout=5)
    return client.sent


ANSWERS = {"decide": DECIDED, "reconcile": RECONCILED}


@pytest.mark.parametrize("kind", ["decide", "reconcile"])
async def test_a_change_answered_in_time_sends_no_refresh(kind: str) -> None:
    assert await _refreshes(kind, ANSWERS[kind]) == []


@pytest.mark.parametrize("kind", ["decide", "reconcile"])
async def test_a_change_answered_past_half_its_timeout_refreshes_its_run(kind: str) -> None:
    assert await _refreshes(kind, ANSWERS[kind], started_ago=16) == ["run-1:refresh"]


@pytest.mark.parametrize("kind", ["decide", "reconcile"])
@pytest.mark.parametrize(
    "refusal",
    [
        TenantNotAllowedError("not yours"),  # the store's
        # One the workflow takes as final (routing.final): it looks nothing
        # up and follows nothing, so there is nothing to wake it for.
        ApplicationError("not pinned", type="snapshot_not_pinned", non_retryable=True),
    ],
    ids=["store", "non-retryable"],
)
async def test_a_refusal_sends_no_refresh(kind: str, refusal: Exception) -> None:
    assert await _refreshes(kind, refusal) == []


@pytest.mark.parametrize("kind", ["decide", "reconcile"])
@pytest.mark.parametrize(
    "failure",
    [
        asyncio.CancelledError(),  # its timeout: the store's call ran to its end first
        ActionSecretKeyError("no secret on this worker"),  # the workflow looks it up
        ApplicationError("retry me"),
    ],
    ids=["cancelled", "failed", "retryable"],
)
async def test_a_change_that_may_have_committed_refreshes_its_run(
    kind: str, failure: BaseException
) -> None:
    assert await _refreshes(kind, failure) == ["run-1:refresh"]


# ------------------------------------------------------------ end to end


async def test_a_decision_the_tool_worker_refuses_sends_no_refresh(tmp_path) -> None:
    """The store refuses a tenant-limited approver's fresh word on another
    tenant's write, on the tool worker (a digest mismatch, the other
    refused decision the suite makes, is answered as a conflict instead)."""
    async with harness(tmp_path, worker_factory=workflows_only, dev_server=True) as h:
        handle, approval_id = await _routed_write_waiting(h)
        gina = Decider(user_id="gina", role="user", tenants=("globex",))  # the write is acme's
        decision = attest(
            Decision(approval_id=approval_id, decision="approved", decided_by="gina"),
            gina,
            datetime.now(UTC),
        )
        async with tool_worker(h):
            with pytest.raises(WorkflowUpdateFailedError):
                await handle.execute_update(DECIDE_UPDATE, decision, result_type=str)
        signals = await signals_in(handle)
        await handle.terminate(reason="test cleanup")
    assert signals == []


class _CommitsAfterItsTimeout(_DiesAfterDeciding):
    """The tool worker's store: the reconciliation waits (a slow lock) past
    the activity's timeout, then commits, and only then does the call see
    its cancellation, as the store's calls do (roundtable/completion.py).
    A decision takes the same path (the unit tests above pin both)."""

    def __init__(self, store: Any, committed: asyncio.Event) -> None:
        super().__init__(store, committed)
        self.cancelled, self.release = asyncio.Event(), asyncio.Event()

    async def reconcile_action(self, *args: Any, **kwargs: Any) -> Any:
        caller = asyncio.current_task()
        assert caller is not None

        async def after_its_cancellation() -> Any:
            # No event says a task was cancelled: the SDK cancels it at the timeout.
            while not caller.cancelling():  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            self.cancelled.set()
            await self.release.wait()
            return await self._store.reconcile_action(*args, **kwargs)

        try:  # run to its end, then the cancellation, as the store's calls do
            return await to_completion(after_its_cancellation)()
        finally:
            self._committed.set()


@pytest.mark.timeout(240)
async def test_a_reconciliation_committed_after_its_run_gave_up_is_followed(
    tmp_path, monkeypatch
) -> None:
    """The call is cancelled at its timeout, commits, then raises (neither
    clock is looked at: only the cancellation tells the run). The run had
    looked, found the action still unknown and refused the operator. A
    wait for a reconciliation has no deadline: before, the run waited on
    for good with the store saying succeeded."""
    committed = asyncio.Event()
    shorten_bookkeeping(monkeypatch)
    async with harness(tmp_path, worker_factory=workflows_only, dev_server=True) as h:
        wrap_tool(h.registry, "ticket_update", lost_before_acting)
        await publish(h)
        async with tool_worker(h):
            handle, action_id = await unknown_write(h)
        store = _CommitsAfterItsTimeout(h.store, committed)
        async with tool_worker(h, store=store):
            with pytest.raises(WorkflowUpdateFailedError):  # the run gave up on it
                await asyncio.wait_for(reconcile(handle, action_id, "succeeded"), 60)
            assert (await h.store.get_action(action_id))["status"] == "unknown"
            await asyncio.wait_for(store.cancelled.wait(), 60)  # the SDK's own timeout
            store.release.set()
            await asyncio.wait_for(committed.wait(), 20)
            assert (await h.store.get_action(action_id))["status"] == "succeeded"
            await h.wait_for(handle, lambda s: not s.unknown_actions, within=30)
            await asyncio.wait_for(handle.result(), 60)  # and the run goes on to its end
