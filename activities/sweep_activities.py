"""The sweep: what no single run's workflow can do for itself.

- expire overdue approvals and recover lapsed leases of runs whose workflow is
  gone or stuck;
- settle runs whose workflow closed without telling the store (terminated by
  hand, timed out, never started): a final status that says what happened,
  executing writes made unknown, open approvals withdrawn;
- mark runs whose workflow cannot make progress (every workflow task failing,
  e.g. on a payload no worker can decrypt) as ``stalled``, with the failure,
  and restore them when they recover.
Idempotent: a second run, or a concurrent one, finds nothing left to change.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import Field
from temporalio import activity
from temporalio.api.failure.v1 import Failure
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode

from roundtable.models import Model, RunState
from roundtable.names import REFRESH_SIGNAL
from roundtable.states import STALLED_AFTER_ATTEMPTS, ActionStatus, RunStatus
from roundtable.store import Store

# A run row is written just before its workflow starts: give the start time
# to happen before calling a missing workflow lost.
MISSING_WORKFLOW_GRACE = timedelta(minutes=2)
CHECKS_AT_ONCE = 8
QUERY_TIMEOUT = timedelta(seconds=5)
log = logging.getLogger("roundtable.sweep")
OPEN_STATUSES = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.WAITING_INPUT, RunStatus.STALLED)
CLOSED_AS = {
    WorkflowExecutionStatus.COMPLETED: RunStatus.COMPLETED,
    WorkflowExecutionStatus.FAILED: RunStatus.FAILED,
    WorkflowExecutionStatus.CANCELED: RunStatus.CANCELLED,
    WorkflowExecutionStatus.TERMINATED: RunStatus.TERMINATED,
    WorkflowExecutionStatus.TIMED_OUT: RunStatus.TERMINATED,
}


class SweepOutput(Model):
    expired_approvals: list[str]
    unknown_actions: list[str]
    run_ids: list[str]
    settled_runs: list[str] = Field(default_factory=list)
    stalled_runs: list[str] = Field(default_factory=list)


class SweepActivities:
    def __init__(self, store: Store, client: Client | None = None) -> None:
        self.store = store
        self._client = client  # default: the worker's own client

    @activity.defn(name="sweep_store")
    async def sweep_store(self) -> SweepOutput:
        expired = await self.store.expire_due_approvals()
        recovered = await self.store.recover_expired_action_leases()
        settled, stalled = await self.check_runs()
        runs = sorted({e["run_id"] for e in expired} | {a["run_id"] for a in recovered})
        return SweepOutput(
            expired_approvals=[e["id"] for e in expired],
            unknown_actions=[a["id"] for a in recovered],
            run_ids=runs,
            settled_runs=settled,
            stalled_runs=stalled,
        )

    async def check_runs(self) -> tuple[list[str], list[str]]:
        """Hold every open run against its workflow; returns the runs settled
        as closed and the runs found stalled."""
        client = self._client or activity.client()
        open_runs = [
            r for status in OPEN_STATUSES for r in await self.store.list_runs(status=status)
        ]
        limit = asyncio.Semaphore(CHECKS_AT_ONCE)

        async def check(run: dict[str, Any]) -> str | None:
            async with limit:
                if activity.in_activity():
                    activity.heartbeat()
                try:
                    return await self._check_run(client, run)
                except Exception as exc:  # one run's trouble never stops the sweep
                    log.warning("could not check run %s: %s", run["id"], exc)
                    return None

        verdicts = await asyncio.gather(*(check(run) for run in open_runs))
        settled = [r["id"] for r, v in zip(open_runs, verdicts, strict=True) if v == "settled"]
        stalled = [r["id"] for r, v in zip(open_runs, verdicts, strict=True) if v == "stalled"]
        return settled, stalled

    async def _check_run(self, client: Client, run: dict[str, Any]) -> str | None:
        handle = client.get_workflow_handle(run["id"])
        try:
            described = await handle.describe()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            if datetime.now(UTC) - run["created_at"] < MISSING_WORKFLOW_GRACE:
                return None
            await self.store.settle_closed_run(
                run["id"],
                RunStatus.TERMINATED,
                {"code": "workflow_missing", "message": "the run's workflow does not exist"},
            )
            return "settled"
        closed_as = CLOSED_AS.get(described.status)  # type: ignore[arg-type]
        if closed_as is not None:
            name = described.status.name.lower()  # type: ignore[union-attr]
            message = await _closing_reason(client, handle) or f"the workflow closed as {name}"
            await self.store.settle_closed_run(
                run["id"], closed_as, {"code": f"workflow_{name}", "message": message}
            )
            return "settled"
        task = described.raw_description.pending_workflow_task
        if task.attempt >= STALLED_AFTER_ATTEMPTS:
            if run["status"] != RunStatus.STALLED:
                cause = await _last_task_failure(client, handle) or "workflow tasks keep failing"
                await self.store.set_run_status(
                    run["id"],
                    RunStatus.STALLED,
                    {
                        "code": "workflow_task_failing",
                        "message": f"{cause} (attempt {task.attempt})",
                    },
                )
            return "stalled"
        if run["status"] == RunStatus.STALLED:  # it recovered: back to what it says
            said = described.search_attributes.get("RoundtableStatus") or [RunStatus.RUNNING]
            back = said[0] if said[0] in (RunStatus.RUNNING, RunStatus.WAITING_INPUT) else "running"
            await self.store.set_run_status(run["id"], back)
        elif run["status"] == RunStatus.WAITING_INPUT:
            await self._nudge_if_settled(handle)
        return None

    async def _nudge_if_settled(self, handle: WorkflowHandle) -> None:
        """A run waiting on an action the store says is settled (reconciled
        in the store, the nudge lost) is told to look. A query adds nothing
        to the run's history; only a run that needs it gets the signal."""
        try:
            state = await handle.query("state", result_type=RunState, rpc_timeout=QUERY_TIMEOUT)
        except Exception:  # no worker can answer now: next time
            return
        if not state.reads_store_on_refresh:
            return  # started before refreshes were read: a nudge would only grow its history
        for action_id in state.unknown_actions:
            action = await self.store.get_action(action_id)
            if action["status"] in (ActionStatus.SUCCEEDED, ActionStatus.FAILED):
                await handle.signal(REFRESH_SIGNAL)
                return


async def _last_events(handle: WorkflowHandle, limit: int = 50) -> list[Any]:
    events: list[Any] = []
    async for event in handle.fetch_history_events():
        events.append(event)
        del events[:-limit]
    return events


async def _closing_reason(client: Client, handle: WorkflowHandle) -> str | None:
    for event in reversed(await _last_events(handle, 1)):
        if event.HasField("workflow_execution_terminated_event_attributes"):
            reason = event.workflow_execution_terminated_event_attributes.reason
            return f"terminated: {reason}" if reason else "terminated"
        if event.HasField("workflow_execution_timed_out_event_attributes"):
            return "the workflow timed out"
        if event.HasField("workflow_execution_failed_event_attributes"):
            return await _message(client, event.workflow_execution_failed_event_attributes.failure)
    return None


async def _last_task_failure(client: Client, handle: WorkflowHandle) -> str | None:
    for event in reversed(await _last_events(handle)):
        if event.HasField("workflow_task_failed_event_attributes"):
            return await _message(client, event.workflow_task_failed_event_attributes.failure)
    return None


async def _message(client: Client, failure: Failure) -> str:
    """A failure's message; failures are encrypted like payloads."""
    try:
        return str(await client.data_converter.decode_failure(failure))[:1000]
    except Exception:  # a key this process lacks: say so rather than nothing
        return "the failure's message is sealed with a payload key this worker lacks"
