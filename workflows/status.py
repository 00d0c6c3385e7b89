"""What a run shows the world while it runs: its status in the store, the
search attributes SREs filter by, and the current details the Temporal UI
shows (what the run waits for, and the command that unblocks it)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

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
    patch) let the two writes that change what the run waits for carry the
    run's status in their own transactions: the intercept that opens an
    approval, the decision that closes one (``carrying``). Such a write tells
    the board what it left in the store (``told``), and the next publish skips
    its own store write when it would write just that. The board trusts a
    write's word only when no other status write was in flight beside it:
    their commits could land in either order, so then it forgets what the
    store holds and the next publish writes it again. Nothing is held while a
    write runs, so a decision that keeps failing stalls nobody else. Approvals
    already decided (``decided``) no longer count as waiting. Everything else
    publishes as it always did; older runs publish every change themselves."""

    def __init__(self, state: RunState, request: RunInput, decided: Callable[[str], bool]) -> None:
        self.state, self.request = state, request
        self.failure: dict[str, str] | None = None  # why the run failed, once it has
        self.lean = False
        self._decided = decided  # whether an approval's decision is in (lean runs)
        self._lock = asyncio.Lock()
        self._published: tuple[str, int, int] | None = None
        self._writing = 0  # status writes in flight: carried ones and publishes
        self._contested = False  # two were in flight at once since _writing was 0
        self._told: str | None = None  # what an uncontested carried write left

    def _waiting_on(self) -> list[str]:
        if not self.lean:
            return list(self.state.pending_approvals)
        return [a for a in self.state.pending_approvals if not self._decided(a)]

    def wanted(self, deciding: str | None = None) -> str:
        """What the run shows now; with ``deciding``, once that approval is decided."""
        if self.state.status in FINAL:
            return self.state.status
        pending = [a for a in self._waiting_on() if a != deciding]
        if (
            pending
            or self.state.unknown_actions
            or self.state.blocked_reason
            or self.state.blocked_writes
            or self.state.unserved_calls
        ):
            return "waiting_input"
        return "running"

    def while_waiting(self) -> str | None:
        """What an intercept that opens an approval carries (None: older runs)."""
        return "waiting_input" if self.lean else None

    def once_decided(self, approval_id: str) -> str | None:
        """What a decision on ``approval_id`` carries (None: older runs)."""
        return self.wanted(deciding=approval_id) if self.lean else None

    @contextlib.asynccontextmanager
    async def carrying(self) -> AsyncIterator[None]:
        """Around a write that may carry the run's status (lean runs)."""
        if not self.lean:
            yield
            return
        self._begin_write()
        try:
            yield
        finally:
            self._end_write()

    def told(self, stored: str | None) -> None:
        """The carried write left the run's status at ``stored`` (None: it
        carried none). Call inside ``carrying``, right after the write."""
        if self.lean and stored is not None:
            self._told = None if self._contested else stored

    def _begin_write(self) -> None:
        self._writing += 1
        if self._writing > 1:
            self._contested = True

    def _end_write(self) -> bool:
        """True when writes overlapped: what the store holds is unknown."""
        self._writing -= 1
        contested = self._contested
        if self._writing == 0 and contested:
            self._contested = False
            self._told = None
            self._published = None  # the next publish writes everything again
        return contested

    async def publish(self, force: bool = False) -> None:
        """Mirror the status to the store, search attributes and UI details."""
        async with self._lock:
            status = self.wanted()
            shown = (
                status,
                len(self._waiting_on()),
                len(self.state.unknown_actions),
                # Lines added since (worker roles, per-write reasons): none before.
                *sorted(self.state.unserved_calls.values()),
                *sorted(self.state.blocked_writes.values()),
            )
            if shown == self._published and not force:
                self._told = None  # a word about the store is good for one publish
                return
            self.state.status = status
            held = self.lean and self._told == status  # a carried write left it there
            self._told = None
            contested = False
            if force or not held:
                if self.lean:
                    self._begin_write()
                try:
                    await workflow.execute_local_activity_method(
                        RunActivities.set_run_status,
                        RunStatusInput(
                            run_id=self.state.run_id, status=status, failure=self.failure
                        ),
                        start_to_close_timeout=BOOKKEEPING,
                        summary=f"run is {status}",
                    )
                finally:
                    if self.lean:
                        contested = self._end_write()
            workflow.upsert_search_attributes(
                [
                    sa.STATUS.value_set(status),
                    sa.USER_ID.value_set(self.request.user_id),
                    sa.PENDING_APPROVALS.value_set(shown[1]),
                    sa.UNKNOWN_ACTIONS.value_set(shown[2]),
                ]
            )
            workflow.set_current_details(self.details())
            # Overlapped by a carried write: the store may hold either status.
            self._published = None if contested else shown

    def details(self) -> str:
        usage = self.state.usage
        lines = [
            f"**{self.state.status}** · round {self.state.round}/{self.request.max_rounds}"
            f" · tokens {usage.prompt_tokens} in / {usage.completion_tokens} out"
        ]
        waiting = set(self._waiting_on())
        for approval_id, write in self.state.pending_approvals.items():
            if approval_id not in waiting:
                continue
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
        lines.extend(f"- {why}" for why in sorted(set(self.state.blocked_writes.values())))
        lines.extend(f"- {why}" for why in sorted(set(self.state.unserved_calls.values())))
        return "\n".join(lines)
