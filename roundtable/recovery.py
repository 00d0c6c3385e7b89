"""Recovery of a run whose history this code can no longer replay.

A run stalls when its workflow tasks fail with a nondeterminism error: a
worker recorded commands that this code, replaying the history, does not make
again (a worker that split one activation in two after taking a run over,
tests/histories_nondeterministic/README.md; or a deploy that changed the
command order). Every task after that point fails too, so the run makes no
progress, and retrying cannot help.

Recovery resets the run's workflow to the first workflow task whose commands
this code does not make again. The new execution keeps the history before
that task and runs the task again live; signals and updates that came after
it are sent again by Temporal. Everything the dropped tail did is still in
the store, and a reset run meets its writes again in whatever state the store
holds them (tests/test_reset.py): nothing runs twice, and the run is told to
re-read the store. Only a nondeterminism is recovered: any other replay
failure (a payload no key opens, say) is not mended by a reset, and is
reported instead."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType, WorkflowExecutionStatus
from temporalio.api.history.v1 import HistoryEvent
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest
from temporalio.client import Client, WorkflowHistory
from temporalio.converter import DataConverter
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import Replayer
from temporalio.workflow import NondeterminismError

from roundtable.operations import TemporalUnavailableError, nudge
from roundtable.states import FINAL_RUN_STATUSES
from roundtable.store import ConflictError, NotFoundError, Store
from roundtable.workflow_runner import workflow_runner
from workflows.roundtable import RoundtableWorkflow

COMPLETED = EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
STARTED = EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED


# The SDK's core says a history holds commands this code does not make in
# one of two ways: a nondeterminism error (a command of another kind or id
# than the event), or its state machines refusing an event outright (a timer
# started where this code cancels one, say), which reaches Python as a bare
# RuntimeError with this text (tests/test_recovery.py makes one).
MACHINES_REFUSED = "Fatal error in workflow machines"


def diverges(failure: Exception) -> bool:
    """Whether a replay failed because the history's commands are not this code's."""
    return isinstance(failure, NondeterminismError) or MACHINES_REFUSED in str(failure)


class ReplaysError(ConflictError):
    """The run's history replays on this code: there is nothing to recover."""


class NotRecoverableError(ConflictError):
    """The run's history fails to replay for a reason a reset does not mend."""


async def _failure(
    workflow_id: str, events: Sequence[HistoryEvent], converter: DataConverter
) -> Exception | None:
    replayer = Replayer(
        workflows=[RoundtableWorkflow],
        data_converter=converter,
        workflow_runner=workflow_runner(),
    )
    history = WorkflowHistory(workflow_id, list(events))
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    return result.replay_failure


def _through_next_task(events: Sequence[HistoryEvent], index: int) -> int:
    """How many events to replay so that the commands recorded by the task
    completed at ``events[index]`` are all checked: up to and including the
    next task's start (the Replayer runs that last task live, checking
    nothing of it), or the whole history if no task started after it."""
    for later in range(index + 1, len(events)):
        if events[later].event_type == STARTED:
            return later + 1
    return len(events)


async def first_divergent_task(history: WorkflowHistory, converter: DataConverter) -> int | None:
    """The event id of the first workflow task completion whose commands this
    code does not make again, or None if the whole history replays. Raises
    NotRecoverableError when it fails to replay for another reason.

    A history that diverges at one task fails every replay that reaches it,
    so the first such task is found by bisection over the task completions:
    a few replays, not one per task."""
    events = list(history.events)
    failure = await _failure(history.workflow_id, events, converter)
    if failure is None:
        return None
    if not diverges(failure):
        raise NotRecoverableError(f"the run's history does not replay: {failure}")
    completions = [i for i, event in enumerate(events) if event.event_type == COMPLETED]
    if not completions:
        raise NotRecoverableError(f"the run's first task does not replay: {failure}")
    low, high = 0, len(completions) - 1  # the answer is in completions[low..high]
    while low < high:
        middle = (low + high) // 2
        prefix = events[: _through_next_task(events, completions[middle])]
        if await _failure(history.workflow_id, prefix, converter) is None:
            low = middle + 1
        else:
            high = middle
    return events[completions[low]].event_id


async def recover_run(
    client: Client, store: Store, run_id: str, operator: str, note: str
) -> dict[str, Any]:
    """Reset the stalled run's workflow to its first task this code does not
    replay; audited under ``operator``, who the caller has made sure is one,
    with their ``note`` (why).
    Refused (ConflictError) for a run that has ended, whose workflow is not
    running, or whose history replays."""
    run = await store.get_run(run_id)
    if run["status"] in FINAL_RUN_STATUSES:
        raise ConflictError(f"run {run_id} has ended ({run['status']}): nothing to recover")
    handle = client.get_workflow_handle(run_id)
    try:
        described = await handle.describe()
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise NotFoundError(f"run {run_id} has no workflow") from exc
        if exc.status == RPCStatusCode.UNAVAILABLE:
            raise TemporalUnavailableError(f"Temporal is unavailable: {exc.message}") from exc
        raise
    if described.raw_description.workflow_execution_info.status != (
        WorkflowExecutionStatus.WORKFLOW_EXECUTION_STATUS_RUNNING
    ):
        raise ConflictError(f"run {run_id}'s workflow is not running: nothing to recover")
    # This execution's own history: a reset names the execution it resets.
    history = await client.get_workflow_handle(run_id, run_id=described.run_id).fetch_history()
    event_id = await first_divergent_task(history, client.data_converter)
    if event_id is None:
        raise ReplaysError(f"run {run_id}'s history replays on this code: nothing to recover")
    reason = f"roundtable recover by {operator}: task completed at event {event_id} does not replay"
    try:
        response = await client.workflow_service.reset_workflow_execution(
            ResetWorkflowExecutionRequest(
                namespace=client.namespace,
                workflow_execution=WorkflowExecution(workflow_id=run_id, run_id=described.run_id),
                reason=reason,
                workflow_task_finish_event_id=event_id,
                # Two operators recovering the same stall at once reset once:
                # Temporal answers the second request with the first's run.
                request_id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"{described.run_id}/{event_id}")),
                identity=operator,
            )
        )
    except RPCError as exc:
        if exc.status in (RPCStatusCode.NOT_FOUND, RPCStatusCode.FAILED_PRECONDITION):
            raise ConflictError(f"run {run_id} could not be reset: {exc.message}") from exc
        raise
    await store.record_recovery(
        run_id,
        by=operator,
        from_execution=described.run_id,
        to_execution=response.run_id,
        reset_to_event=event_id,
        note=note,
    )
    await nudge(client, run_id)  # the new execution re-reads what the store holds
    return {
        "run_id": run_id,
        "reset_to_event": event_id,
        "from_execution": described.run_id,
        "execution": response.run_id,
    }
