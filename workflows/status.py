"""What a run shows the world while it runs: its status in the store, the
search attributes SREs filter by, and the current details the Temporal UI
shows (what the run waits for, and the command that unblocks it)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.run_activities import RunActivities
    from roundtable.models import RunInput, RunState, RunStatusInput


from workflows import search_attributes as sa
from workflows.timeouts import BOOKKEEPING

FINAL = ("completed", "failed", "cancelled")


class StatusBoard:
    """Publishes a run's status whenever what it shows changes. Publishing is
    serialised, so seats working concurrently never publish out of order.

    Lean runs (``lean``, set by the run for runs started after the lean-status
    patch) let the writes that change what the run waits for carry the run's
    new status in their own transaction: the intercept that opens an approval,
    the decision that closes one. Each runs under this board's lock (see
    ``exclusive``) and tells the board what the store now holds (``told``), so
    the board knows the store's status at every point and publishes to it only
    what it does not hold yet; the search attributes and details follow as
    before. Older runs publish every change themselves, as they always did."""

    def __init__(self, state: RunState, request: RunInput) -> None:
        self.state, self.request = state, request
        self.failure: dict[str, str] | None = None  # why the run failed, once it has
        self.lean = False
        self._lock = asyncio.Lock()
        self._published: tuple[str, int, int] | None = None
        self._stored: str | None = None  # the status the store holds, as far as we know

    def wanted(self, deciding: str | None = None) -> str:
        """What the run shows now; with ``deciding``, once that approval is decided."""
        if self.state.status in FINAL:
            return self.state.status
        pending = set(self.state.pending_approvals) - {deciding}
        if pending or self.state.unknown_actions or self.state.blocked_reason:
            return "waiting_input"
        return "running"

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold publishing while a write that carries the run's status runs
        (lean runs only: an older run's commands must keep their order)."""
        if not self.lean:
            yield
            return
        async with self._lock:
            yield

    def told(self, stored: str | None) -> None:
        """A write's transaction left the run's status at ``stored`` (None:
        it carried none). Call inside ``exclusive``."""
        if self.lean and stored is not None:
            self._stored = stored

    async def publish(self, force: bool = False) -> None:
        """Mirror the status to the store, search attributes and UI details."""
        async with self._lock:
            status = self.wanted()
            published = (status, len(self.state.pending_approvals), len(self.state.unknown_actions))
            held = self.lean and status == self._stored  # the store shows it already
            if published == self._published and (held or not self.lean) and not force:
                return
            self.state.status = status
            if force or not held:
                await workflow.execute_local_activity_method(
                    RunActivities.set_run_status,
                    RunStatusInput(run_id=self.state.run_id, status=status, failure=self.failure),
                    start_to_close_timeout=BOOKKEEPING,
                    summary=f"run is {status}",
                )
                self._stored = status
            if published == self._published and not force:
                return  # only the store was behind
            workflow.upsert_search_attributes(
                [
                    sa.STATUS.value_set(status),
                    sa.USER_ID.value_set(self.request.user_id),
                    sa.PENDING_APPROVALS.value_set(published[1]),
                    sa.UNKNOWN_ACTIONS.value_set(published[2]),
                ]
            )
            workflow.set_current_details(self.details())
            self._published = published

    def details(self) -> str:
        usage = self.state.usage
        lines = [
            f"**{self.state.status}** · round {self.state.round}/{self.request.max_rounds}"
            f" · tokens {usage.prompt_tokens} in / {usage.completion_tokens} out"
        ]
        for approval_id, write in self.state.pending_approvals.items():
            lines.append(
                f"- waiting for approval of {write.tool_name} by {write.seat}: "
                f"`roundtable approve {approval_id}`"
            )
        for action_id, write in self.state.unknown_actions.items():
            lines.append(
                f"- outcome unknown for {write.tool_name} by {write.seat}: "
                f"`roundtable reconcile {action_id} --outcome succeeded|failed`"
            )
        if self.state.blocked_reason:
            lines.append(f"- {self.state.blocked_reason}")
        return "\n".join(lines)
