"""Where a run's tool calls go (worker roles, README "Worker roles").

A workflows worker holds no tool code. Its runs learn, when they open
(ensure_run, recorded in the history), which task queue serves each tool;
every activity that needs a tool (its read, the intercept of its write, the
write itself, a decision on it, a reconciliation that fences it) is then
scheduled there. A run whose ``tool_queues`` is empty (one worker does
everything, and every run recorded before roles) schedules exactly what it
always did.

No worker polling a tool's queue is not an error. A routed activity has one
attempt only (Temporal retries none of them), so a schedule-to-start timeout
says for certain that nothing of it ran: it is scheduled again, waiting
longer each time (a call waiting for days must not fill its history), and
the run shows which tool waits on which queue. Any other failure is the
caller's to judge: a read that may not run twice is told so (``prior_attempt``),
a message handler re-reads the store before it answers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.api.enums.v1 import TimeoutType
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError
from temporalio.exceptions import TimeoutError as TemporalTimeout

with workflow.unsafe.imports_passed_through():
    from roundtable.models import RunInput, RunState
    from roundtable.names import NO_TOOL_WORKER

from workflows.timeouts import (
    HANDLER_TOOL_WORKER_WAIT,
    ONCE,
    RETRY_BUSY_FIRST,
    TOOL_WORKER_WAIT,
    TOOL_WORKER_WAIT_MAX,
)


def never_started(exc: BaseException) -> bool:
    """Whether a one-attempt activity failed because no worker ever took it:
    then it certainly did not run, and may be scheduled again."""
    cause = exc.cause if isinstance(exc, ActivityError) else None
    return (
        isinstance(cause, TemporalTimeout)
        and cause.type == TimeoutType.TIMEOUT_TYPE_SCHEDULE_TO_START
    )


def final(exc: BaseException) -> bool:
    """A failure its activity marked not worth retrying (a refusal, bad input)."""
    cause = exc.cause if isinstance(exc, ActivityError) else None
    return isinstance(cause, ApplicationError) and cause.non_retryable


def cancelled(exc: BaseException) -> bool:
    return isinstance(exc, ActivityError) and isinstance(exc.cause, CancelledError)


def no_worker(tool_name: str, queue: str) -> str:
    return f"{tool_name} waits: no tool worker serves it (task queue {queue!r})"


class GaveUp(Exception):
    """The run is ending while a call still waits for a tool worker."""


class ToolRoutes:
    def __init__(
        self, state: RunState, request: RunInput, publish: Callable[[], Awaitable[None]]
    ) -> None:
        self.state, self._publish = state, publish
        seconds = request.tool_worker_wait_seconds
        self._wait = TOOL_WORKER_WAIT if seconds is None else timedelta(seconds=seconds)

    def queue(self, tool_name: str) -> str | None:
        """The task queue serving ``tool_name`` elsewhere, or None: here."""
        return self.state.tool_queues.get(tool_name)

    def options(self, tool_name: str, wait: timedelta | None = None) -> dict[str, Any]:
        """Activity options sending one attempt of a ``tool_name`` call to its
        queue, waiting ``wait`` for a worker to take it (empty: not routed)."""
        queue = self.queue(tool_name)
        if queue is None:
            return {}
        return {
            "task_queue": queue,
            "schedule_to_start_timeout": wait or self._wait,
            "retry_policy": ONCE,
        }

    async def unserved(self, key: str, reason: str | None) -> None:
        """Show (or, with None, clear) why the call ``key`` waits."""
        shown = self.state.unserved_calls
        if shown.get(key) == reason:
            return
        if reason is None:
            shown.pop(key, None)
        else:
            shown[key] = reason
        await self._publish()

    async def until_served(
        self,
        tool_name: str,
        key: str,
        schedule: Callable[[dict[str, Any], bool], Awaitable[Any]],
        ending: Callable[[], bool],
    ) -> Any:
        """``schedule(options, prior_attempt)`` until an attempt ends: one no
        worker took is scheduled again (each wait twice the last, up to a
        cap), one that failed otherwise is tried again after a backoff, told
        that an earlier attempt may have run. Raises GaveUp when the run is
        ending while no worker takes it; a cancellation goes through."""
        options = self.options(tool_name)
        if not options:
            return await schedule({}, False)
        wait, backoff, prior = options["schedule_to_start_timeout"], RETRY_BUSY_FIRST, False
        closed = False
        try:
            while True:
                if ending():
                    raise GaveUp(tool_name)
                try:
                    return await schedule({**options, "schedule_to_start_timeout": wait}, prior)
                except ActivityError as exc:
                    if cancelled(exc):
                        raise
                    if never_started(exc):
                        await self.unserved(key, no_worker(tool_name, options["task_queue"]))
                        wait = min(wait * 2, TOOL_WORKER_WAIT_MAX)
                        continue
                    if final(exc):  # what Temporal would not have retried either
                        raise
                    workflow.logger.warning("%s failed on its tool worker: %s", tool_name, exc)
                prior = True  # it may have run: what may not run twice will not
                await workflow.sleep(backoff)
                backoff = min(backoff * 2, TOOL_WORKER_WAIT)
        except GeneratorExit:
            # The run was evicted from the worker's cache and its coroutine
            # is being closed, outside any workflow: nothing may be scheduled
            # (the status it would publish is the replaying worker's to show).
            closed = True
            raise
        finally:
            if not closed and key in self.state.unserved_calls:
                await self.unserved(key, None)

    async def once(
        self, tool_name: str, schedule: Callable[[dict[str, Any]], Awaitable[Any]]
    ) -> Any:
        """``schedule(options)`` once, for a message handler, waiting briefly
        for a tool worker (its caller waits, and its attestation ages): when
        none took it, its caller is told plainly that nothing was done."""
        options = self.options(tool_name, min(self._wait, HANDLER_TOOL_WORKER_WAIT))
        try:
            return await schedule(options)
        except ActivityError as exc:
            if options and never_started(exc):
                raise ApplicationError(
                    no_worker(tool_name, options["task_queue"]), type=NO_TOOL_WORKER
                ) from exc
            raise
