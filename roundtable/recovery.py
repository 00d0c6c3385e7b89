"""Recovery of a run whose history this code can no longer replay.

A run stalls when its workflow tasks fail with a nondeterminism: a worker
recorded commands that this code, replaying the history, does not make again
(a worker that split one activation in two after taking a run over,
tests/histories_nondeterministic/README.md; or a deploy that changed the
command order). Every later task fails too, and retrying cannot help.

Recovery resets the run's workflow to the first workflow task at which a
replay with this code fails. The new execution keeps the history before that
task and runs the task again live; Temporal sends signals and updates that
came after it again. What the dropped tail did stays in the store: a reset
run meets its writes in whatever state the store holds them
(tests/test_reset.py), and a model turn run again gives the answer the run
already acted on (activities/run_activities.py, the turn journal), so no write
runs twice. Only a run Temporal shows stalled by a nondeterminism is reset:
its current task must have failed ``STALLED_AFTER_ATTEMPTS`` times with a
nondeterminism, so a healthy run is never reset, even by an operator whose
code differs from the workers'. A claim in the store, taken before the reset,
lets one recovery of an execution run at a time."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType, WorkflowExecutionStatus, WorkflowTaskFailedCause
from temporalio.api.history.v1 import HistoryEvent
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest
from temporalio.bridge.proto.workflow_activation import RemoveFromCache
from temporalio.client import Client, WorkflowExecutionDescription, WorkflowHistory
from temporalio.converter import DataConverter
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import Replayer
from temporalio.workflow import NondeterminismError

from roundtable.operations import TemporalUnavailableError, nudge
from roundtable.states import FINAL_RUN_STATUSES, STALLED_AFTER_ATTEMPTS
from roundtable.store import ConflictError, InvalidInputError, NotFoundError, Store
from roundtable.workflow_runner import workflow_runner
from workflows.roundtable import RoundtableWorkflow

COMPLETED = EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
STARTED = EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED
TASK_FAILED = EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
TASK_TIMED_OUT = EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT
CANCEL_REQUESTED = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCEL_REQUESTED
RUNNING = WorkflowExecutionStatus.WORKFLOW_EXECUTION_STATUS_RUNNING
NONDETERMINISTIC = WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_NON_DETERMINISTIC_ERROR
# The SDK's core says a history holds commands this code does not make in one
# of two ways: a nondeterminism (a command of another kind or id than the
# event), or its state machines refusing an event outright (a timer started
# where this code cancels one, say). The second reaches a worker's task
# failure with this text first, and the Replayer as a RuntimeError whose text
# begins with the eviction reason FATAL (tests/test_recovery.py makes one).
MACHINES_REFUSED = "Fatal error in workflow machines"
_FATAL = f"{int(RemoveFromCache.EvictionReason.FATAL)}: "
# A run recovered this often is not reset again without a person looking.
MOST_RECOVERIES = 3
# A claim older than this whose execution is still current did not reset it
# (a reset answers within seconds): another recovery may claim again.
CLAIM_STALE_AFTER = timedelta(minutes=5)
MAX_NOTE = 2000
# A reset call is given well under CLAIM_STALE_AFTER, so no claim goes stale
# while its own reset may still land; after one that raised, Temporal is asked
# this often whether it reset the run all the same.
RESET_TIMEOUT = timedelta(seconds=30)
OUTCOME_POLLS = 10
OUTCOME_POLL_SECONDS = 1.0
END_ATTEMPTS = 3
# Why a task failing for the third time or more is not yet evidence: its
# failure is not in the history (only the first of a row is written), or it
# timed out. Recovery's signal makes the next failure show.
NOT_RECORDED = "no workflow task has failed since the last one completed"
TIMING_OUT = "its current workflow task is timing out, not failing"
# How long recovery waits for the task its signal brings to end (a failing
# task is retried at once the first times, then every ten seconds).
EVIDENCE_POLLS = 24
EVIDENCE_POLL_SECONDS = 0.5
_UNAVAILABLE = (RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED)


class ReplaysError(ConflictError):
    """The run's history replays on this code: there is nothing to recover."""


class NotRecoverableError(ConflictError):
    """The run is not stalled by a nondeterminism, so a reset would not mend it."""


def diverges(failure: Exception) -> bool:
    """Whether a replay failed because the history's commands are not this code's."""
    if isinstance(failure, NondeterminismError):
        return True
    if not isinstance(failure, RuntimeError):
        return False
    text = str(failure)
    return text.startswith(_FATAL) and MACHINES_REFUSED in text


def failed_by_divergence(event: HistoryEvent) -> bool:
    """Whether a recorded workflow task failure says the history's commands
    are not the worker's code's (as a worker's task failure says it)."""
    failed = event.workflow_task_failed_event_attributes
    return failed.cause == NONDETERMINISTIC or failed.failure.message.startswith(MACHINES_REFUSED)


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
    completed at ``events[index]`` are checked: up to and including the next
    task's start (the Replayer runs that last task live, checking nothing of
    it), or the whole history if no task started after it."""
    for later in range(index + 1, len(events)):
        if events[later].event_type == STARTED:
            return later + 1
    return len(events)


async def first_divergent_task(history: WorkflowHistory, converter: DataConverter) -> int | None:
    """The event id of the first workflow task completion at which a replay
    of the history with this code fails, or None if the whole history
    replays. Raises NotRecoverableError when a replay fails for another
    reason than a divergence (a payload no key opens, say).

    Every task before the answer replays: the history a reset keeps is one
    this code follows. The answer is where a replay first fails, not always
    the task that first differed: a task that made fewer commands than this
    code makes is seen only at a later task's commands, so the reset may come
    later than the first difference, never earlier than needed. A replay that
    fails at one task fails every longer replay, so the task completions are
    bisected: a few replays, not one per task."""
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
        shorter = await _failure(history.workflow_id, prefix, converter)
        if shorter is None:
            low = middle + 1
        elif diverges(shorter):
            high = middle
        else:
            raise NotRecoverableError(f"the run's history does not replay: {shorter}")
    return events[completions[low]].event_id


def not_stalled_by_divergence(attempt: int, history: WorkflowHistory) -> str | None:
    """Why Temporal does not show this execution stalled by a nondeterminism,
    or None if it does: its current task has failed at least
    STALLED_AFTER_ATTEMPTS times, and since the last task that completed,
    the last task to end failed with a nondeterminism. An old nondeterminism
    a later task got past, or a task now timing out, is no such evidence."""
    last_end = None
    for event in history.events:
        if event.event_type == COMPLETED:
            last_end = None
        elif event.event_type in (TASK_FAILED, TASK_TIMED_OUT):
            last_end = event
    if last_end is None:
        return NOT_RECORDED
    if last_end.event_type == TASK_TIMED_OUT:
        return TIMING_OUT
    if not failed_by_divergence(last_end):
        message = last_end.workflow_task_failed_event_attributes.failure.message
        return f"its workflow tasks fail for another reason: {message[:300]}"
    if attempt < STALLED_AFTER_ATTEMPTS:
        # A signal makes Temporal start the failing task afresh (attempt 1).
        return (
            f"its current workflow task has failed {max(attempt - 1, 1)} times with a "
            f"nondeterminism, fewer than {STALLED_AFTER_ATTEMPTS}: try again shortly"
        )
    return None


async def _read(
    client: Client, run_id: str
) -> tuple[WorkflowExecutionDescription, WorkflowHistory]:
    described = await client.get_workflow_handle(run_id).describe()
    if described.raw_description.workflow_execution_info.status != RUNNING:
        raise ConflictError(f"run {run_id}'s workflow is not running: nothing to recover")
    history = await client.get_workflow_handle(run_id, run_id=described.run_id).fetch_history()
    return described, history


def _task_ended_after(history: WorkflowHistory, after: int) -> bool:
    """Whether a workflow task completed or failed after event ``after``."""
    return any(
        event.event_id > after and event.event_type in (COMPLETED, TASK_FAILED)
        for event in history.events
    )


async def _evidence(
    client: Client, run_id: str
) -> tuple[WorkflowExecutionDescription, WorkflowHistory, str | None]:
    """``(description, history, why not)``. The history holds only the first
    failure of a row of failing tasks (and a task that timed out first holds
    none): then the run is signalled, which makes Temporal write its next
    task afresh (attempt 1), and that task's failure, written after the
    signal, is the evidence; a task that completes instead says the run is
    healthy. Waits a little for that task."""
    described, history = await _read(client, run_id)
    attempt = described.raw_description.pending_workflow_task.attempt
    why_not = not_stalled_by_divergence(attempt, history)
    if why_not not in (NOT_RECORDED, TIMING_OUT):
        return described, history, why_not
    if attempt < STALLED_AFTER_ATTEMPTS:
        return described, history, f"its workflow tasks are not failing (attempt {attempt})"
    before = history.events[-1].event_id
    await nudge(client, run_id)
    for _ in range(EVIDENCE_POLLS):
        await asyncio.sleep(EVIDENCE_POLL_SECONDS)
        described, history = await _read(client, run_id)
        if _task_ended_after(history, before):
            # A fresh task's own failure counts whatever its attempt number.
            return described, history, not_stalled_by_divergence(STALLED_AFTER_ATTEMPTS, history)
    return described, history, why_not


def _temporal_error(exc: RPCError, run_id: str) -> Exception:
    if exc.status in _UNAVAILABLE:
        return TemporalUnavailableError(f"Temporal is unavailable: {exc.message}")
    if exc.status == RPCStatusCode.NOT_FOUND:
        return NotFoundError(f"run {run_id} has no workflow")
    return ConflictError(f"run {run_id}: Temporal refused: {exc.message}")


async def recover_run(
    client: Client, store: Store, run_id: str, operator: str, note: str
) -> dict[str, Any]:
    """Reset the stalled run's workflow to its first task at which a replay
    with this code fails; audited under ``operator``, who the caller has made
    sure is one, with their ``note`` (why). Refused (ConflictError) for a run
    that has ended, whose workflow is not running or not stalled by a
    nondeterminism, whose history replays, whose recovery is under way, or
    that was recovered MOST_RECOVERIES times already."""
    note = note.strip()
    if not note or len(note) > MAX_NOTE:
        raise InvalidInputError(f"note: say why, in 1 to {MAX_NOTE} characters", field="note")
    run = await store.get_run(run_id)
    if run["status"] in FINAL_RUN_STATUSES:
        raise ConflictError(f"run {run_id} has ended ({run['status']}): nothing to recover")
    try:
        described, history, why_not = await _evidence(client, run_id)
    except RPCError as exc:
        raise _temporal_error(exc, run_id) from exc
    if why_not is not None:
        raise NotRecoverableError(f"run {run_id} is not stalled by a nondeterminism: {why_not}")
    event_id = await first_divergent_task(history, client.data_converter)
    if event_id is None:
        raise ReplaysError(f"run {run_id}'s history replays on this code: nothing to recover")
    execution = described.run_id
    claim = await store.begin_recovery(
        run_id,
        from_execution=execution,
        by=operator,
        note=note,
        reset_to_event=event_id,
        most=MOST_RECOVERIES,
        stale_after=CLAIM_STALE_AFTER,
    )
    # Under the claim, to its end even if the caller goes away (a client
    # that hangs up must not leave a reset unrecorded).
    claimed = _Claimed(client, store, run_id, execution, event_id, claim, operator)
    return await asyncio.shield(claimed.recover(seen=history.events[-1].event_id))


class RecoveryOutcomeUnknownError(TemporalUnavailableError):
    """Temporal did not say whether it reset the run, and could not be asked:
    the claim stays until it goes stale, so nobody resets the run meanwhile."""


@dataclass
class _Claimed:
    client: Client
    store: Store
    run_id: str
    execution: str
    event_id: int
    claim: str
    operator: str

    @property
    def reason(self) -> str:
        # The claim makes the reason this reset's alone (_outcome reads it back).
        return (
            f"roundtable recover ({self.claim}) by {self.operator}: "
            f"replay fails at event {self.event_id}"
        )

    async def recover(self, seen: int) -> dict[str, Any]:
        try:
            described, history = await _read(self.client, self.run_id)
            if described.run_id != self.execution:
                raise ConflictError(f"run {self.run_id} moved on from execution {self.execution}")
            if any(e.event_id > seen and e.event_type == COMPLETED for e in history.events):
                raise ConflictError(f"run {self.run_id} completed a workflow task meanwhile")
        except Exception as exc:
            await self._failed(exc)
            raise
        try:
            response = await self.client.workflow_service.reset_workflow_execution(
                ResetWorkflowExecutionRequest(
                    namespace=self.client.namespace,
                    workflow_execution=WorkflowExecution(
                        workflow_id=self.run_id, run_id=self.execution
                    ),
                    reason=self.reason,
                    workflow_task_finish_event_id=self.event_id,
                    request_id=str(uuid.uuid4()),
                    identity=self.operator,
                ),
                timeout=RESET_TIMEOUT,
            )
            new_execution: str | None = response.run_id
        except Exception as exc:
            new_execution = await self._outcome()
            if new_execution is None:
                await self._failed(exc)
                if isinstance(exc, RPCError):
                    raise _temporal_error(exc, self.run_id) from exc
                raise
        return await self._recovered(new_execution)

    async def _failed(self, exc: BaseException) -> None:
        await self.store.end_recovery(
            self.run_id,
            claim=self.claim,
            from_execution=self.execution,
            to_execution=None,
            failure=str(exc)[:500],
        )

    async def _outcome(self) -> str | None:
        """After a reset call that raised: the new execution if Temporal reset
        the run all the same (the old one ended terminated with this reset's
        reason), None if it did not (the old one still runs, well past the
        call's deadline). Raises RecoveryOutcomeUnknownError if Temporal
        cannot be asked."""
        for _ in range(OUTCOME_POLLS):
            try:
                old = self.client.get_workflow_handle(self.run_id, run_id=self.execution)
                last = (await old.fetch_history()).events[-1]
                if last.HasField("workflow_execution_terminated_event_attributes"):
                    if last.workflow_execution_terminated_event_attributes.reason != self.reason:
                        return None  # ended otherwise: not by this reset
                    return (await self.client.get_workflow_handle(self.run_id).describe()).run_id
                info = (await old.describe()).raw_description.workflow_execution_info
                if info.status == RUNNING:
                    return None
            except RPCError:
                pass
            await asyncio.sleep(OUTCOME_POLL_SECONDS)
        raise RecoveryOutcomeUnknownError(
            f"run {self.run_id}: Temporal did not say whether it reset execution "
            f"{self.execution}; the recovery's claim holds for "
            f"{CLAIM_STALE_AFTER.total_seconds() / 60:.0f} minutes: look at the run"
        )

    async def _recovered(self, new_execution: str) -> dict[str, Any]:
        carried = False
        cancel = await self._cancel_to_carry()
        if cancel:
            with contextlib.suppress(Exception):
                await self.client.get_workflow_handle(self.run_id, run_id=new_execution).cancel()
                carried = True
        for attempt in range(END_ATTEMPTS):  # the reset happened: it must be recorded
            try:
                await self.store.end_recovery(
                    self.run_id,
                    claim=self.claim,
                    from_execution=self.execution,
                    to_execution=new_execution,
                    cancel_carried=carried,
                )
                break
            except Exception:
                if attempt == END_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(1)
        with contextlib.suppress(RPCError):
            await nudge(self.client, self.run_id)  # the new execution re-reads the store
        if cancel and not carried:
            raise ConflictError(
                f"run {self.run_id} was reset to execution {new_execution}, but the cancel "
                "asked of it while it was stalled could not be asked again: cancel it"
            )
        return {
            "run_id": self.run_id,
            "reset_to_event": self.event_id,
            "from_execution": self.execution,
            "execution": new_execution,
        }

    async def _cancel_to_carry(self) -> bool:
        """Whether a cancel was asked of the old execution that the history
        the reset kept does not hold. Temporal's reset carries signals and
        updates, not cancel requests; one asked while a task fails is not even
        in the history (the execution's description says so), and one asked
        while this recovery ran is read here, after the reset."""
        try:
            old = self.client.get_workflow_handle(self.run_id, run_id=self.execution)
            asked = (await old.describe()).raw_description.workflow_extended_info.cancel_requested
            events = (await old.fetch_history()).events
        except RPCError:
            return False
        requests = [e.event_id for e in events if e.event_type == CANCEL_REQUESTED]
        kept = any(event_id < self.event_id for event_id in requests)
        return (asked or bool(requests)) and not kept
