"""Where a run's tool calls go (worker roles, README "Worker roles").

A workflows worker holds no tool code. Its runs learn, when they open
(ensure_run, recorded in the history), which task queue serves each tool;
every activity that needs a tool (its read, the intercept of its write, the
write itself, a decision on it, a reconciliation that fences it) is then
scheduled there. A run whose ``tool_queues`` is empty (one worker does
everything, and every run recorded before roles) schedules exactly what it
always did.

No worker polling a tool's queue is not an error: the activity is never
started (a schedule-to-start timeout says so for certain), so it is simply
scheduled again, and the run shows why it waits.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.api.enums.v1 import TimeoutType
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.exceptions import TimeoutError as TemporalTimeout

with workflow.unsafe.imports_passed_through():
    from roundtable.models import RunInput, RunState
    from roundtable.names import NO_TOOL_WORKER

from workflows.timeouts import TOOL_WORKER_WAIT


def never_started(exc: BaseException) -> bool:
    """Whether an activity failed because no worker ever took it: then it
    certainly did not run, and may be scheduled again whatever it does."""
    cause = exc.cause if isinstance(exc, ActivityError) else None
    return (
        isinstance(cause, TemporalTimeout)
        and cause.type == TimeoutType.TIMEOUT_TYPE_SCHEDULE_TO_START
    )


def no_worker(tool_name: str, queue: str) -> str:
    return f"{tool_name} waits: no tool worker serves it (task queue {queue!r})"


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

    def options(self, tool_name: str) -> dict[str, Any]:
        """Activity options sending a call of ``tool_name`` to its queue."""
        queue = self.queue(tool_name)
        if queue is None:
            return {}
        return {"task_queue": queue, "schedule_to_start_timeout": self._wait}

    async def until_served(
        self, tool_name: str, schedule: Callable[[dict[str, Any]], Awaitable[Any]]
    ) -> Any:
        """``schedule(options)`` until a worker takes it. While none does, the
        run's details say which tool waits and on which queue."""
        options = self.options(tool_name)
        waited = False
        while True:
            try:
                result = await schedule(options)
            except ActivityError as exc:
                if not options or not never_started(exc):
                    raise
                waited = True
                self.state.blocked_reason = no_worker(tool_name, options["task_queue"])
                await self._publish()
                continue
            if waited and self.state.blocked_reason == no_worker(tool_name, options["task_queue"]):
                self.state.blocked_reason = None
                await self._publish()
            return result

    async def once(
        self, tool_name: str, schedule: Callable[[dict[str, Any]], Awaitable[Any]]
    ) -> Any:
        """``schedule(options)`` once, for a message handler: its caller is
        told plainly when no tool worker took it (nothing was done)."""
        options = self.options(tool_name)
        try:
            return await schedule(options)
        except ActivityError as exc:
            if options and never_started(exc):
                raise ApplicationError(
                    no_worker(tool_name, options["task_queue"]), type=NO_TOOL_WORKER
                ) from exc
            raise
