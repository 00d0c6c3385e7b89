"""An approval's two timers: the "expiring soon" warning and the deadline.

In the manner of samples-python's updatable timer: the deadline lives on the
write and may move while we wait (an extension, or the database's word on
it), so every wait arms a fresh timer for whichever of the two comes next.

Only a fired timer says that a time has come (runs with the
approval-times-decided-by-timers patch). ``workflow.now()`` is the start time
of the current workflow task, and a worker that took a run over was seen to
read another one than the history holds (tests/histories_nondeterministic/).
Whatever the clock chose, a warning sent or a timer armed, could then differ
between the worker that ran the task and every worker replaying it. So the
clock only sets how long a timer runs (replay does not compare durations) and
a wait always arms one, at least ``SHORTEST`` long, even for a time already
past: a timer of zero is no timer at all.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from enum import Enum

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from roundtable.models import PendingWrite

# The shortest timer a wait arms. Any positive length is a timer command;
# zero or less would be none, and a clock could then decide which.
SHORTEST = timedelta(milliseconds=1)


class Wake(Enum):
    WOKEN = "woken"  # the condition held: a decision, a refresh, the run ending
    WARNING = "warning"  # time to warn that the approval expires soon
    DEADLINE = "deadline"  # the deadline the timer was armed for has come


class ApprovalClock:
    def __init__(
        self, write: PendingWrite, lead: timedelta, warn: bool, timers_decide: bool = False
    ) -> None:
        """``lead``: how long before the deadline to warn. With ``warn`` off
        (no webhook receivers: nobody to warn) there is no warning timer, the
        same commands as before webhooks existed, so old histories replay.
        ``timers_decide`` off: a run from before the patch, where the clock
        also decided (kept so its history replays)."""
        self.write, self.lead = write, lead
        self._warned = not warn
        self._timer_fired = False  # the warning's timer, not the deadline's
        self._timers_decide = timers_decide

    def _warn_at(self):  # type: ignore[no-untyped-def]
        return self.write.approval_deadline - self.lead

    def warning_due(self) -> bool:
        """True once, when the warning's time has come: its timer fired, or
        the clock says so. The fired timer is enough on its own: a worker that
        took the run over mid-way was seen to read a clock from before the
        timer fired (workflow.now() of the task before), re-arm the timer
        instead of warning, and leave a history no worker could replay
        (tests/histories_nondeterministic/). With ``timers_decide``, only the
        fired timer: a lead longer than the approval arms a timer of
        ``SHORTEST`` rather than warning on the clock's say."""
        if self._warned:
            return False
        if not self._timer_fired and (self._timers_decide or workflow.now() < self._warn_at()):
            return False
        self._warned = True
        return True

    async def wait(self, woken: Callable[[], bool]) -> Wake:
        """Wait for ``woken`` or the next of the two times."""
        approval_id = self.write.approval_id
        if self._warned:
            until, summary = self.write.approval_deadline, f"approval expiry {approval_id}"
        else:
            until, summary = self._warn_at(), f"approval expiring soon {approval_id}"
        # The clock sets only the timer's length; with timers_decide, a timer
        # is armed however late the clock says it is.
        shortest = SHORTEST if self._timers_decide else timedelta(0)
        try:
            await workflow.wait_condition(
                woken,
                timeout=max(until - workflow.now(), shortest),
                timeout_summary=summary,
            )
        except TimeoutError:
            if self._warned:
                return Wake.DEADLINE
            self._timer_fired = True
            return Wake.WARNING
        return Wake.WOKEN
