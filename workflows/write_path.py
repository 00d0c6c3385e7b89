"""The write path: each write a seat asks for, steered from wherever the
store says it stands to its end.

waiting_approval → (decision, or the deadline) → approved → claimed and run
once under a lease → succeeded | failed | unknown → (an operator reconciles).
The store decides every transition; this only waits, asks and follows.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.write_activities import WriteActivities
    from roundtable.models import (
        ActionRef,
        ApprovalRef,
        DecisionRecorded,
        ExecuteWriteInput,
        ExecuteWriteOutput,
        PendingWrite,
        ReconcileInput,
        ReconcileOutput,
        RecordDecisionInput,
        RunInput,
        RunState,
        ToolOutcome,
    )
    from roundtable.states import ActionStatus, ApprovalStatus, ClaimOutcome

from workflows.approval_clock import ApprovalClock, Wake
from workflows.notifier import Notifier
from workflows.routing import ToolRoutes, never_started, no_worker
from workflows.status import StatusBoard
from workflows.timeouts import (
    BOOKKEEPING,
    ONCE,
    RETRY_BLOCKED_MAX,
    RETRY_BUSY_FIRST,
    RETRY_BUSY_MAX,
    TOOL_CALL,
    TOOL_WORKER_WAIT_MAX,
)

SETTLED = (ActionStatus.SUCCEEDED, ActionStatus.FAILED)
# Runs that reach a blocked target after this change keep one reason per
# write (RunState.blocked_writes) instead of one line for the whole run.
PER_WRITE_BLOCKED_PATCH = "per-write-blocked-reasons"


@dataclass
class Inbox:
    """What the run's messages, and its ending, tell the writes under way."""

    after_decision: dict[str, str] = field(default_factory=dict)  # approval → action status
    after_reconcile: dict[str, str] = field(default_factory=dict)  # action → status
    edits: dict[str, list] = field(default_factory=dict)  # approval → what an operator changed
    refreshes: int = 0  # bumped by each refresh signal and extension: look again
    ending: str | None = None  # why the run is ending early (failed, cancelled)
    # Runs started with the marker rules-as-of-2026-12 take every rule below,
    # and the patches each run otherwise asks for when it first needs them
    # (handlers-finish-before-completion, per-write-blocked-reasons), without
    # asking (run() decides).
    current_rules: bool = False
    # Runs started before safety-rules-v1 keep the old rules (run() decides).
    new_rules: bool = True
    # A refresh wakes a write waiting for its target (the write or the
    # reconciliation that frees it sends one); older runs wait their timers.
    wakes_on_refresh: bool = False
    # Only fired timers say an approval's warning or deadline has come
    # (ApprovalClock); older runs let workflow.now() decide.
    timers_decide: bool = False


class WritePath:
    def __init__(
        self,
        state: RunState,
        request: RunInput,
        inbox: Inbox,
        status: StatusBoard,
        notifier: Notifier,
        routes: ToolRoutes,
    ) -> None:
        self.state, self.request, self.inbox = state, request, inbox
        self.status, self.notifier, self.routes = status, notifier, routes
        # Worker roles: writes whose last attempt no tool worker took, and
        # how long the next attempt waits for one (doubling up to a cap).
        self._unserved: set[str] = set()
        self._wait_for_worker: dict[str, timedelta] = {}

    async def steer(self, write: PendingWrite) -> ToolOutcome:
        """Steer a write from wherever the store says it stands to its end.
        An action met again (after a reset or retry) may already be executing,
        unknown or done: it is tracked exactly like one made just now."""
        if write.rejection is not None:
            return write.rejection
        status = write.status
        if status == ActionStatus.WAITING_APPROVAL:
            status = await self._await_decision(write)
        if not self.inbox.new_rules and status != ActionStatus.APPROVED:
            return _outcome(write, status, {"error_code": "not_approved"})
        if status in (ActionStatus.APPROVED, ActionStatus.EXECUTING):
            outcome = await self._execute(write)
            edits = self.inbox.edits.get(write.approval_id or "")
            if edits:  # the seat learns what the operator changed before approving
                outcome.content = {**outcome.content, "operator_edits": edits}
            return outcome
        if status == ActionStatus.UNKNOWN:
            return await self._await_reconciliation(write, write.result, self.inbox.refreshes)
        if status in SETTLED:
            return _outcome(write, status, write.result or {})
        return _outcome(write, status, {"error_code": "not_approved"})

    async def _await_decision(self, write: PendingWrite) -> str:
        approval_id = write.approval_id
        self.state.pending_approvals[approval_id] = write
        await self.status.publish()
        about = {
            "approval_id": approval_id,
            "action_id": write.action_id,
            "tool_name": write.tool_name,
            "seat": write.seat,
        }
        self.notifier.notify("approval.requested", approval_id, about)
        clock = ApprovalClock(
            write,
            lead=timedelta(seconds=self.state.expiring_lead_seconds),
            warn=bool(self.state.webhook_urls),
            timers_decide=self.inbox.timers_decide,
        )
        seen_refreshes = self.inbox.refreshes

        def woken(seen: int = seen_refreshes) -> bool:
            return (
                approval_id in self.inbox.after_decision
                or self.inbox.refreshes != seen
                or bool(self.inbox.ending)
            )

        while approval_id not in self.inbox.after_decision and not self.inbox.ending:
            if clock.warning_due():
                self.notifier.notify(
                    "approval.expiring",
                    approval_id,
                    {**about, "expires_at": write.approval_deadline.isoformat()},
                )
            wake = await clock.wait(lambda seen=seen_refreshes: woken(seen))
            if wake is Wake.DEADLINE:
                await self._expire(write)
                continue
            if wake is Wake.WARNING:
                continue
            if (
                approval_id not in self.inbox.after_decision
                and self.inbox.refreshes != seen_refreshes
            ):
                seen_refreshes = self.inbox.refreshes  # the sweep or an extension: look again
                await self.check_approval(write)
        if approval_id not in self.inbox.after_decision:  # the run is ending: nobody will decide
            withdrawn = await workflow.execute_local_activity_method(
                WriteActivities.withdraw_write,
                ActionRef(action_id=write.action_id),
                start_to_close_timeout=BOOKKEEPING,
                summary="withdraw approval: the run is ending",
            )
            self.inbox.after_decision[approval_id] = withdrawn.status
        self.state.pending_approvals.pop(approval_id, None)
        await self.status.publish()
        return self.inbox.after_decision[approval_id]

    async def _expire(self, write: PendingWrite) -> None:
        """Expire against the deadline the timer was armed for. If an extension
        committed first, the database keeps the approval pending and tells us
        its new deadline: wait for that one instead."""
        expired = await workflow.execute_local_activity_method(
            WriteActivities.expire_approval,
            ApprovalRef(
                approval_id=write.approval_id,
                deadline=write.approval_deadline if self.inbox.new_rules else None,
            ),
            start_to_close_timeout=BOOKKEEPING,
            summary="expire approval",
        )
        self.follow(write, expired, answered=True)

    async def check_approval(self, write: PendingWrite) -> str:
        """Follow the store's word on the approval; returns its status."""
        seen = await workflow.execute_local_activity_method(
            WriteActivities.approval_status,
            ApprovalRef(approval_id=write.approval_id),
            start_to_close_timeout=BOOKKEEPING,
            summary="check approval",
        )
        self.follow(write, seen)
        return seen.approval_status

    async def request_decision(
        self, write: PendingWrite, request: RecordDecisionInput
    ) -> DecisionRecorded:
        """Follow the store's word on the approval (its edits told to the
        seat, whoever made them), as a decision whose activity failed on a
        tool worker left it; the answer says whether the decision that
        stands is this request's (no conflict)."""
        seen = await workflow.execute_local_activity_method(
            WriteActivities.request_decision,
            request,
            start_to_close_timeout=BOOKKEEPING,
            summary="check decision",
        )
        self.follow(write, seen)
        return seen

    def follow(self, write: PendingWrite, seen: DecisionRecorded, answered: bool = False) -> None:
        """Take the database's word on an approval: decided only once it is no
        longer pending; while pending, its deadline is the one that counts.
        (Old rules: an expiry or a decision ended the wait whatever the
        database answered; a mere look ended it only once not pending.)
        Edits it names are the ones the write goes out with, whichever
        answer told of them first: the seat is told of them."""
        if seen.edits:
            self.inbox.edits.setdefault(write.approval_id, seen.edits)
        if not self.inbox.new_rules:
            if answered or seen.approval_status != ApprovalStatus.PENDING:
                self.inbox.after_decision.setdefault(write.approval_id, seen.status)
            return
        if seen.approval_status != ApprovalStatus.PENDING:
            self.inbox.after_decision.setdefault(write.approval_id, seen.status)
        elif seen.expires_at is not None and seen.expires_at > write.approval_deadline:
            write.approval_deadline = seen.expires_at

    async def _execute(self, write: PendingWrite) -> ToolOutcome:
        """Claim and run the write; back off on a busy target; never re-run an
        attempt whose fate is unclear."""
        wait = RETRY_BUSY_FIRST
        seen_refreshes = self.inbox.refreshes
        while True:
            # Counted before the attempt: a wake that lands while the attempt
            # is under way (it found the target taken just before it freed)
            # still ends the wait that follows.
            refreshes = self.inbox.refreshes
            if self.inbox.ending:
                done = await workflow.execute_local_activity_method(
                    WriteActivities.withdraw_write,
                    ActionRef(action_id=write.action_id),
                    start_to_close_timeout=BOOKKEEPING,
                    summary="withdraw write: the run is ending",
                )
            else:
                done = await self._attempt(write)
            if self.routes.queue(write.tool_name) is not None:  # worker roles
                unserved = write.action_id in self._unserved
                self._unserved.discard(write.action_id)
                reason = no_worker(write.tool_name, self.routes.queue(write.tool_name))
                await self.routes.unserved(write.action_id, reason if unserved else None)
            if done.status in SETTLED:
                self._blocked(write, None, always=True)
                await self.status.publish()
                return _outcome(write, done.status, done.result or {})
            if done.status == ActionStatus.UNKNOWN:
                self._blocked(write, None)
                return await self._await_reconciliation(write, done.result, seen_refreshes)
            if done.status == ActionStatus.REJECTED and self.inbox.new_rules:  # withdrawn
                self._blocked(write, None)
                return _outcome(write, done.status, done.result or {"error_code": "not_approved"})
            # Still approved (or executing under another attempt's live lease):
            # the target is busy or blocked, or the attempt failed before it
            # claimed. Wait on a durable timer and try again.
            blocked = done.claim == ClaimOutcome.TARGET_RECONCILIATION_REQUIRED
            self._blocked(
                write,
                f"{write.tool_name} for {write.seat} waits: another action on its target "
                "is unknown and must be reconciled"
                if blocked
                else None,
                always=True,
            )
            await self.status.publish()
            ending = bool(self.inbox.ending)
            with contextlib.suppress(TimeoutError):
                # Woken early when the run starts ending; once it is ending, a
                # plain timer (an attempt of another run of this workflow, say
                # before a reset, still holds the action: wait for its end).
                # Woken early too when the target frees (a refresh signal).
                await workflow.wait_condition(
                    lambda ending=ending, refreshes=refreshes: (
                        (bool(self.inbox.ending) and not ending)
                        or (self.inbox.wakes_on_refresh and self.inbox.refreshes != refreshes)
                    ),
                    timeout=wait,
                    timeout_summary=f"target busy, retry {write.tool_name}",
                )
            wait = min(wait * 2, RETRY_BLOCKED_MAX if blocked else RETRY_BUSY_MAX)

    def _blocked(self, write: PendingWrite, reason: str | None, always: bool = False) -> None:
        """Say (or, with None, stop saying) that ``write`` waits for another
        action's reconciliation. Each write has its own line (patch
        per-write-blocked-reasons): one write's end no longer erases another's
        reason. Older runs keep the one shared line, which only the settled
        and retry paths (``always``) ever wrote."""
        mine = write.action_id in self.state.blocked_writes
        if reason is None and not mine and self.state.blocked_reason is None:
            return  # nothing to take back: no marker, no change
        if not (self.inbox.current_rules or workflow.patched(PER_WRITE_BLOCKED_PATCH)):
            if always:
                self.state.blocked_reason = reason
            return
        # A run from before the patch may still show the shared line: the
        # write it was about says again if it still waits.
        self.state.blocked_reason = None
        if reason is None:
            self.state.blocked_writes.pop(write.action_id, None)
        else:
            self.state.blocked_writes[write.action_id] = reason

    async def _attempt(self, write: PendingWrite) -> ExecuteWriteOutput:
        """One execution. Never interrupted by the run ending: a write under
        way always reaches a recorded outcome."""
        heartbeat = timedelta(seconds=self.request.heartbeat_timeout_seconds)
        routed = self.routes.options(write.tool_name, self._wait_for_worker.get(write.action_id))
        try:
            return await workflow.execute_activity_method(
                WriteActivities.execute_write,
                ExecuteWriteInput(
                    action_id=write.action_id,
                    seat=write.seat,
                    lease_seconds=self.request.lease_seconds,
                    heartbeat_interval_seconds=heartbeat.total_seconds() / 3,
                ),
                start_to_close_timeout=TOOL_CALL,
                heartbeat_timeout=heartbeat,
                summary=f"execute {write.tool_name} for {write.seat}",
                **{"retry_policy": ONCE, **routed},
            )
        except ActivityError as exc:
            if routed and never_started(exc):  # nothing ran: it waits, and says why
                waited = routed["schedule_to_start_timeout"]
                self._wait_for_worker[write.action_id] = min(waited * 2, TOOL_WORKER_WAIT_MAX)
                self._unserved.add(write.action_id)
            return await workflow.execute_local_activity_method(
                WriteActivities.settle_write,
                ActionRef(action_id=write.action_id),
                start_to_close_timeout=BOOKKEEPING,
                summary="settle interrupted write",
            )

    async def check_reconciled(self, action_id: str) -> str:
        """Take the store's word on an unknown action: once settled, it is
        reconciled here too. Returns its status."""
        now = await workflow.execute_local_activity_method(
            WriteActivities.action_status,
            ActionRef(action_id=action_id),
            start_to_close_timeout=BOOKKEEPING,
            summary="check reconciliation",
        )
        if now.status in SETTLED:
            self.inbox.after_reconcile.setdefault(action_id, now.status)
        return now.status

    async def reconciled_by_request(self, request: ReconcileInput) -> ReconcileOutput:
        """Take the store's word on an unknown action, as a reconciliation
        whose activity failed on a tool worker left it: once settled, it is
        reconciled here too; the answer says whether what stands is this
        request's reconciliation (no conflict), never another's."""
        seen = await workflow.execute_local_activity_method(
            WriteActivities.reconciled_by_request,
            request,
            start_to_close_timeout=BOOKKEEPING,
            summary="check reconciliation by request",
        )
        if seen.status in SETTLED:
            self.inbox.after_reconcile.setdefault(request.action_id, seen.status)
        return seen

    async def _await_reconciliation(
        self, write: PendingWrite, result: dict | None, seen_refreshes: int
    ) -> ToolOutcome:
        """Wait until someone reconciles the action: through this workflow's
        update, or directly in the store (then a refresh signal wakes us to
        read it). A run that ends meanwhile leaves it unknown, still
        reconcilable in the store."""
        self.state.unknown_actions[write.action_id] = write
        await self.status.publish()
        self.notifier.notify(
            "action.unknown",
            write.action_id,
            {"action_id": write.action_id, "tool_name": write.tool_name, "seat": write.seat},
        )
        while write.action_id not in self.inbox.after_reconcile and not self.inbox.ending:
            await workflow.wait_condition(
                lambda seen=seen_refreshes: (
                    write.action_id in self.inbox.after_reconcile
                    or self.inbox.refreshes != seen
                    or bool(self.inbox.ending)
                )
            )
            refreshed = self.inbox.refreshes != seen_refreshes
            seen_refreshes = self.inbox.refreshes
            if (
                refreshed
                and self.inbox.new_rules
                and write.action_id not in self.inbox.after_reconcile
            ):
                await self.check_reconciled(write.action_id)
        self.state.unknown_actions.pop(write.action_id, None)
        await self.status.publish()
        status = self.inbox.after_reconcile.get(write.action_id, ActionStatus.UNKNOWN)
        reconciled = status != ActionStatus.UNKNOWN
        return _outcome(write, status, {"reconciled": reconciled, **(result or {})})


def _outcome(write: PendingWrite, status: str, content: dict) -> ToolOutcome:
    return ToolOutcome(
        call_id=write.call_id, tool_name=write.tool_name, status=status, content=content
    )
