"""Activities on the write path: intercept, decide, expire, execute, settle, reconcile.

Only ``execute_write`` touches the outside world, and it never retries: it
claims the target lease, invokes the tool once while heartbeating and renewing
the lease, and records the result. Everything else is idempotent bookkeeping
that may run as a local activity. (Over 400 lines on purpose: every activity
a write meets, in the order it meets them, on the one class the worker
registers and the workflow's write path references.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError

from activities.bounded import bounded_result
from activities.errors import log_refusal, typed_store_errors
from activities.lease_keeper import CallOutcome, LeaseTerms, call_under_lease, heartbeating
from activities.run_activities import pinned_snapshot, require_own_run
from roundtable.models import (
    ActionRef,
    ApprovalRef,
    CallRef,
    Decision,
    DecisionRecorded,
    ExecuteWriteInput,
    ExecuteWriteOutput,
    ExtendInput,
    ExtendOutput,
    InterceptInput,
    PendingWrite,
    ReconcileInput,
    ReconcileOutput,
    ReconcileRequest,
    RecordDecisionInput,
    SignalSender,
    ToolOutcome,
)
from roundtable.names import CONFLICT
from roundtable.operations import nudge
from roundtable.permissions import (
    AttestationExpiredError,
    Authority,
    Decider,
    TenantNotAllowedError,
    check_reconciler,
    check_tenant,
    decider_whatever_its_age,
    verified_decider,
)
from roundtable.security import (
    ActionSecretKeyError,
    ArgumentsDecryptionError,
    CapabilityError,
    decrypt_arguments,
    redact_result,
    redact_text,
    target_of,
)
from roundtable.states import REFUSED, RUN_ENDED_REASON, ActionStatus, ApprovalStatus, WriteEnd
from roundtable.store import (
    AttemptMayBeRunningError,
    ClaimOutcome,
    ConflictError,
    InvalidInputError,
    NotFoundError,
    Store,
    StoreError,
    as_stored,
)
from roundtable.store.decision import change_recorded
from roundtable.telemetry.logs import bind
from roundtable.telemetry.metrics import Metrics
from roundtable.telemetry.tracing import tool_span
from roundtable.tools.policy import initial_action_status
from roundtable.tools.registry import (
    ToolArgumentsError,
    ToolContext,
    ToolDefiniteFailure,
    ToolDefinition,
    ToolRegistry,
)

T = TypeVar("T")
log = logging.getLogger("roundtable.activities")
EXECUTION_INTERRUPTED = "execution_interrupted"
LEASE_LOST = "lease_lost"


class WriteActivities:
    def __init__(
        self,
        store: Store,
        registry: ToolRegistry,
        temporal: Client | None = None,
        *,
        authority: Authority,
        metrics: Metrics | None = None,
        tools_here: bool = True,
    ) -> None:
        self.store = store
        self.registry = registry
        # False on a workflows worker: its registry is empty by design, so a
        # tool missing from it says nothing about the tool (it is elsewhere).
        self.tools_here = tools_here
        self.temporal = temporal  # to read who sent a signal, from the history
        self.authority = authority
        self.metrics = metrics or Metrics()
        # Refreshes sent after routed decisions and reconciliations, held
        # until sent (a task nobody holds may be collected before it runs).
        self._telling: set[asyncio.Task[None]] = set()

    @activity.defn(name="signal_sender")
    async def signal_sender(self, inp: SignalSender) -> str | None:
        """The Temporal identity that sent this very signal. The SDK does not
        hand it to signal handlers, but the history records it: the signal is
        found by its payload (which carries a request id), and when the history
        cannot tell whose it was (no match, or senders that differ sent the
        same payload) the answer is None: never someone else's identity."""
        if self.temporal is None:
            return None
        history = await self.temporal.get_workflow_handle(inp.workflow_id).fetch_history()
        converter = self.temporal.data_converter
        senders = set()
        for event in history.events:
            if not event.HasField("workflow_execution_signaled_event_attributes"):
                continue
            signalled = event.workflow_execution_signaled_event_attributes
            if signalled.signal_name != inp.signal_name or len(signalled.input.payloads) != 1:
                continue
            (payload,) = await converter.decode(list(signalled.input.payloads), [dict])
            if payload == inp.payload:
                senders.add(signalled.identity or "")
        if len(senders) != 1:
            return None
        return senders.pop() or None

    # ----------------------------------------------------------------- intercept

    @activity.defn(name="intercept_write")
    @typed_store_errors
    async def intercept_write(self, inp: InterceptInput) -> PendingWrite:
        """Turn a write tool call into a persisted action (and approval).
        The idempotency key comes from run, seat, round and call id, so running
        this twice yields one action."""
        call, spec = inp.call, inp.snapshot.tool(inp.call.name)
        refused = _call_refusal(inp, spec)
        if refused is not None:
            return refused
        require_own_run(inp.run_id)
        tool = self.registry.get(call.name)
        try:
            if tool is None:
                raise ToolArgumentsError(f"{call.name} is not available on this worker")
            arguments = tool.normalize(call.arguments)
            # _call_refusal checked the seat's grant; the spec is the snapshot's.
            target = target_of(spec.model_dump(), arguments)
        except (ToolArgumentsError, CapabilityError) as exc:
            return _refused_write(inp, "invalid_arguments", str(exc))
        run = await self.store.get_run(inp.run_id)
        pinned_snapshot(run, inp.snapshot, tool)
        try:
            check_tenant(run["tenants"], _tenant_of(tool, arguments), f"run {inp.run_id}")
        except TenantNotAllowedError as exc:
            await self.store.record_refusal(
                inp.run_id,
                call_key=f"{inp.seat}:r{inp.round}:{call.id}",
                seat=inp.seat,
                tool_name=call.name,
                code=exc.code,
                message=str(exc),
            )
            return _refused_write(inp, exc.code, str(exc))
        # What the server granted this run, whatever the workflow was started with.
        policy = self.authority.granted_policy(run, inp.write_policy, inp.request_fingerprint)
        status = initial_action_status(policy, spec.risk_level)
        try:
            action = await self._create_action(inp, arguments, target, status, spec)
        except ConflictError as exc:
            # The call's id already names another write of this run (a model
            # reusing ids across a reset, say): never merged, never run.
            return _refused_write(inp, "call_id_reused", str(exc))
        if "approval_expires_at" in action:  # opened just now, with the run's status
            deadline = action["approval_expires_at"]
        elif action["approval_id"]:
            deadline = (await self.store.get_approval(action["approval_id"]))["expires_at"]
        else:
            deadline = None
        return PendingWrite(
            action_id=action["id"],
            call_id=call.id,
            seat=inp.seat,
            tool_name=call.name,
            status=action["status"],
            approval_id=action["approval_id"],
            approval_deadline=deadline,
            run_status=action.get("run_status"),
            # Met again after a reset, retry or continue-as-new: what it came to.
            result=await self._bounded(action, action["result"]),
        )

    async def _create_action(
        self, inp: InterceptInput, arguments: dict[str, Any], target: Any, status: str, spec: Any
    ) -> dict[str, Any]:
        call = inp.call
        return await self.store.create_action(
            {
                "session_id": inp.session_id,
                "run_id": inp.run_id,
                "agent_id": inp.seat,
                "tool_name": call.name,
                "logical_action_id": call.id,
                "turn_index": inp.round,
                "idempotency_key": f"{inp.run_id}:{inp.seat}:r{inp.round}:{call.id}",
                "target_key": target.key,
                "target_scope": target.scope,
                "target_namespace_wide": target.namespace_wide,
                "risk_level": spec.risk_level,
                "status": status,
                "arguments": arguments,
                "safe_argument_fields": spec.safe_argument_fields,
                **(
                    {"approval_expires_at": inp.approval_deadline}
                    if status == ActionStatus.WAITING_APPROVAL
                    else {}
                ),
            },
            run_status=inp.run_status_while_waiting,
        )

    # ----------------------------------------------------------------- decisions

    @activity.defn(name="decide_approval")
    @typed_store_errors
    async def decide_approval(self, request: RecordDecisionInput) -> DecisionRecorded:
        """Compare-and-set the decision. A conflict is reported with the
        approval's real status, so the workflow follows the database."""
        approval_id = request.decision.approval_id

        async def run_of_the_approval() -> str:
            return str((await self.store.get_approval(approval_id))["run_id"])

        return await self._telling_the_run_if_late(
            lambda: self._decide(request), run_of_the_approval
        )

    async def _telling_the_run_if_late(
        self, change: Callable[[], Awaitable[T]], run_id_of: Callable[[], Awaitable[str]]
    ) -> T:
        """An operator's change (a decision, a reconciliation) made by this
        activity: on a tool worker, its run may have given up on the call
        (its start-to-close timeout, then a lookup that found nothing
        changed yet) while the change still committed. Then nothing else
        would tell the run: it would wait on (to the approval's deadline, or
        with no deadline for a reconciliation) with the store saying
        changed. So the run is sent a refresh when the change was cancelled
        or failed other than by a refusal (it may have committed first: the
        store's calls run to their end), or answered so late it may have
        been given up on. Only then: a refresh wakes every wait of the run
        (other approvals look again, writes waiting for a target try
        again). A refusal changed nothing: the store's, or a non-retryable
        ApplicationError, which both changes raise only before they write
        anything (``pinned_snapshot``'s, on an edit); one raised after a
        write would have to send the refresh itself. A local activity never
        needs it: its run retries it and finds its record."""
        if activity.info().is_local:
            return await change()
        began = time.monotonic()
        try:
            done = await change()
        except StoreError:  # a refusal: nothing changed, nothing to tell
            raise
        except ApplicationError as exc:
            if not exc.non_retryable:
                self._tell_the_run(run_id_of)
            raise
        except BaseException:  # cancelled, or failed: it may have committed first
            self._tell_the_run(run_id_of)
            raise
        if self._may_have_been_given_up(began):
            self._tell_the_run(run_id_of)
        return done

    @staticmethod
    def _may_have_been_given_up(began: float) -> bool:
        """Whether a routed change answered so late that its run may have
        given up on it already (its start-to-close timeout, then a lookup
        that found nothing changed yet): past half that timeout by this
        worker's clock since the method began, or by the wall clock since
        the server started the attempt (which counts a stall before the
        method began; half the timeout is the margin for the two clocks)."""
        info = activity.info()
        timeout = info.start_to_close_timeout
        if timeout is None:
            return False
        half = timeout.total_seconds() / 2
        since_start = (datetime.now(UTC) - info.started_time).total_seconds()
        return time.monotonic() - began >= half or since_start >= half

    def _tell_the_run(self, run_id_of: Callable[[], Awaitable[str]]) -> None:
        """Send a refresh to the run ``run_id_of`` names, off the activity's
        path (see :meth:`_telling_the_run_if_late`)."""
        if self.temporal is None:
            return
        task = asyncio.get_running_loop().create_task(self._refresh_run(run_id_of))
        self._telling.add(task)
        task.add_done_callback(self._telling.discard)

    async def _refresh_run(self, run_id_of: Callable[[], Awaitable[str]]) -> None:
        assert self.temporal is not None
        try:
            async with asyncio.timeout(30):
                await nudge(self.temporal, await run_id_of())
        except Exception as exc:  # best effort: an operator asking again still gets through
            log.warning("could not tell the run of a change on a tool worker: %s", exc)

    async def _decide(self, request: RecordDecisionInput) -> DecisionRecorded:
        inp = request.decision
        bind(approval_id=inp.approval_id)
        try:
            decider = verified_decider(inp, datetime.now(UTC))
        except AttestationExpiredError as stale:
            # An attempt of a request its earlier attempt recorded (the
            # database starved past the attestation's age, or the run's
            # worker was replaced) is answered with that record; anything
            # else stays refused.
            edited = inp.arguments is not None
            change = change_recorded(inp.decision, edited)
            kept = await self._recorded_despite_age(inp, change, request.request_key, stale)
            run_status = kept[0]["run_status"] if request.run_status else None
            edits = kept[1]["changes"] if edited else None
            return _recorded(kept[0], edits=edits, run_status=run_status)

        def may_decide(run_owner: str, risk_level: str) -> None:
            self.authority.check_decider(decider, run_owner, risk_level)

        if decider.tenants is not None or inp.arguments is not None:
            # Tenant limits need the arguments, edits the run: read first.
            _, action, run = await self.store.decision_context(inp.approval_id)
            may_decide(run["user_id"], action["risk_level"])
            # A tenant-limited approver decides only writes for their tenants.
            tool = self.registry.get(action["tool_name"])
            if decider.tenants is not None:
                if tool is None:  # whose write it is cannot be told here: refuse
                    raise TenantNotAllowedError(
                        f"{action['tool_name']} is not on this worker: the tenant of its "
                        f"write cannot be checked for {decider.user_id}"
                    )
                arguments = await self.store.get_action_arguments(action["id"])
                check_tenant(decider.tenants, _tenant_of(tool, arguments), decider.user_id)
            if inp.arguments is not None:
                return await self._approve_with_edits(request, decider, run, action)
        try:
            decided = await self.store.decide_approval(
                inp.approval_id,
                inp.decision,
                inp.decided_by,
                inp.reason,
                inp.arguments_digest,
                run_status=request.run_status,
                guard=may_decide,
                request_key=request.request_key,
            )
        except ConflictError as exc:
            log_refusal("decide_approval", CONFLICT, exc)
            return await self._decision_view(inp.approval_id, conflict=str(exc))
        run_status = decided["run_status"] if request.run_status else None
        return _recorded(decided, run_status=run_status)

    async def _approve_with_edits(
        self,
        request: RecordDecisionInput,
        decider: Decider,
        run: dict[str, Any],
        action: dict[str, Any],
    ) -> DecisionRecorded:
        """Edited arguments meet every check the original ones met: the tool's
        schema, the run's write policy and grants, a freshly derived target.
        (Whether the arguments are still the ones decided on is checked by the
        store, under the run lock, as it records the decision.)"""
        inp = request.decision
        tool = self.registry.get(action["tool_name"])
        if tool is None or request.snapshot is None:
            raise InvalidInputError(f"{action['tool_name']} cannot be re-validated here")
        pinned_snapshot(run, request.snapshot, tool)
        try:
            arguments = tool.normalize(inp.arguments or {})
            # The seat's grant of this tool was checked when the write was
            # intercepted, against this same (pinned) snapshot.
            spec = request.snapshot.tool(action["tool_name"])
            if spec is None:  # the snapshot is the run's own (pinned): cannot happen
                raise ToolArgumentsError(f"{action['tool_name']} is not in the run's snapshot")
            target = target_of(spec.model_dump(), arguments)
        except (ToolArgumentsError, CapabilityError) as exc:
            said = redact_text(str(exc), inp.arguments, action["safe_argument_fields"])
            raise InvalidInputError(f"edited arguments refused: {said}") from exc
        # Edits may not move a write to a tenant the run or the approver may not act for.
        tenant = _tenant_of(tool, arguments)
        check_tenant(run["tenants"], tenant, f"run {run['id']}")
        check_tenant(decider.tenants, tenant, decider.user_id)
        if initial_action_status(request.write_policy, action["risk_level"]) == (
            ActionStatus.REJECTED
        ):
            raise InvalidInputError("the run's write policy refuses this write")
        try:
            decided, changes = await self.store.approve_with_edits(
                inp.approval_id,
                inp.decided_by,
                inp.reason,
                inp.arguments_digest,
                arguments,
                target,
                request_key=request.request_key,
            )
        except ConflictError as exc:
            log_refusal("decide_approval", CONFLICT, exc)
            return await self._decision_view(inp.approval_id, conflict=str(exc))
        # The answer is the transaction's own, not read after it: a read that
        # failed here would be retried as a decision on an approval already
        # decided (a conflict, the edits lost to the seat).
        return _recorded(decided, edits=changes)

    @activity.defn(name="expire_approval")
    @typed_store_errors
    async def expire_approval(self, ref: ApprovalRef) -> DecisionRecorded:
        """The workflow's deadline timer fired: expire unless a decision won or
        an extension moved the deadline past the one the timer was armed for
        (then the view's ``expires_at`` is the new deadline to wait for)."""
        bind(approval_id=ref.approval_id)
        await self.store.expire_approval(ref.approval_id, ref.deadline)
        return await self._decision_view(ref.approval_id)

    @activity.defn(name="approval_status")
    @typed_store_errors
    async def approval_status(self, ref: ApprovalRef) -> DecisionRecorded:
        return await self._decision_view(ref.approval_id)

    @activity.defn(name="request_decision")
    @typed_store_errors
    async def request_decision(self, request: RecordDecisionInput) -> DecisionRecorded:
        """After a decision's activity failed on a tool worker with no answer
        (it died, or none took it): the approval as it stands, the edits it
        was approved with whoever made them (the write goes out with them,
        so its seat is told), and a conflict unless the decision that stands
        is this request's own record (its key, its person). So a caller is
        never told another's decision is theirs, nor their own another's
        when it cannot be told: a signal has no request id, and a word whose
        MAC fails here (forged, or the action secret rotated on this worker
        last) is not looked up. A word with none is looked up under the
        bare name it claims, as an unattested decision is recorded
        (docs/architecture.md)."""
        inp = request.decision
        bind(approval_id=inp.approval_id)
        change = change_recorded(inp.decision, inp.arguments is not None)
        forged = inp.attested_by is not None and decider_whatever_its_age(inp).role is None
        answered, ours, edits = await self.store.approval_standing(
            inp.approval_id,
            event_type=change,
            request_key=None if forged else request.request_key,
            actor=inp.decided_by,
        )
        run_status = answered["run_status"] if request.run_status else None
        seen = _recorded(answered, edits=edits, run_status=run_status)
        status = seen.approval_status
        if ours or status == ApprovalStatus.PENDING:
            return seen
        if request.request_key is None:
            why = f"{status}: a signal has no request id, so whose decision it is cannot be told"
        elif forged:
            why = f"{status}: this request's attestation does not verify on this worker"
        elif status in (ApprovalStatus.APPROVED, ApprovalStatus.REJECTED):
            why = f"{status} by another request or person"
        else:
            why = str(status)
        return seen.model_copy(update={"conflict": why})

    @activity.defn(name="extend_approval")
    @typed_store_errors
    async def extend_approval(self, inp: ExtendInput) -> ExtendOutput:
        """The worker's own limits hold whatever the message says; who extends
        is whom the API or CLI attested, else recorded as nobody vouched for."""
        bind(approval_id=inp.approval_id)
        rules = self.authority
        try:
            extender = verified_decider(inp, datetime.now(UTC))
        except AttestationExpiredError as stale:  # as for a decision
            extension = "approval.extended"
            kept = await self._recorded_despite_age(inp, extension, inp.request_key, stale)
            return ExtendOutput(approval_id=inp.approval_id, expires_at=kept[0]["expires_at"])
        by = extender.user_id if extender.role else f"unattested:{extender.user_id}"
        approval = await self.store.extend_approval(
            inp.approval_id,
            inp.seconds,
            by[:255],
            min(inp.max_seconds, rules.max_extension_seconds),
            max_extensions=_tighter(inp.max_extensions, rules.max_extensions),
            max_total_seconds=_tighter(inp.max_total_seconds, rules.max_total_seconds),
            request_key=inp.request_key,
        )
        return ExtendOutput(approval_id=approval["id"], expires_at=approval["expires_at"])

    async def _recorded_despite_age(
        self,
        message: Decision | ExtendInput,
        change: str,
        request_key: str | None,
        stale: AttestationExpiredError,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The change ``request_key`` recorded, for an attempt whose
        attestation is too old to make it: read under the run lock, behind
        an earlier attempt still queued or running, and only for the person
        the attestation (checked, whatever its age) names. Without such a
        record the attempt is refused as stale, as before: a request that
        nothing recorded is never first applied with an expired word."""
        vouched = decider_whatever_its_age(message)
        kept = None
        if vouched.role is not None:
            kept = await self.store.keyed_approval_change(
                change,
                message.approval_id,
                request_key,
                actor=vouched.user_id,
                locked=True,
            )
        if kept is None:
            raise stale
        return kept

    async def _decision_view(
        self, approval_id: str, conflict: str | None = None
    ) -> DecisionRecorded:
        """The approval as it stands, with its edits once decided (however
        the run learns of a decision, its seat is told of the edits its
        write goes out with)."""
        answered, _, edits = await self.store.approval_standing(approval_id)
        return _recorded(answered, edits=edits, conflict=conflict)

    # ----------------------------------------------------------------- execution

    @activity.defn(name="execute_write")
    @typed_store_errors
    async def execute_write(self, inp: ExecuteWriteInput) -> ExecuteWriteOutput:
        """Claim, invoke once under the lease, record. Runs with maximum_attempts=1.
        Heartbeats cover all of it: a claim slowed by the database is alive."""
        bind(action_id=inp.action_id)
        async with heartbeating(inp.heartbeat_interval_seconds):
            claimed_at = asyncio.get_running_loop().time()
            claimed = await self.store.claim_for_execution(inp.action_id, inp.lease_seconds)
            claim, action = claimed.outcome, claimed.action
            if claim != ClaimOutcome.CLAIMED or action is None:
                return await self._action_now(inp.action_id, claim)
            terms = LeaseTerms(inp.lease_seconds, inp.heartbeat_interval_seconds, claimed_at)
            status, result, over, interrupted = await self._invoke_under_lease(
                action, claimed.sealed_arguments, terms
            )
            recording = self.store.record_action_terminal_result(
                inp.action_id,
                status,
                result,
                fencing_token=action["fencing_token"],
                external_object_id=_external_id(result),
                attempt_over=over,
            )
            if interrupted:
                # Cancelled from outside (worker shutdown, the server gave up on
                # us): record what we know, best effort, then let go.
                with contextlib.suppress(Exception):
                    await recording
                raise asyncio.CancelledError()
            recorded = await recording
            if status != ActionStatus.UNKNOWN:  # the lease is released: wake who waits
                await self._wake_waiters(action)
            if not recorded:
                # Not recorded as given (recovery made it unknown first, say):
                # report what the database says.
                return await self._action_now(inp.action_id, claim)
            # This attempt's own record, committed: the row holds just this
            # (a read fewer on every write's path).
            return ExecuteWriteOutput(
                claim=claim,
                status=status,
                result=await self._bounded(action, as_stored(result)),
            )

    async def _invoke_under_lease(
        self, action: dict[str, Any], sealed: str | None, terms: LeaseTerms
    ) -> tuple[str, dict[str, Any], bool, bool]:
        """(status, result, attempt over, interrupted) of one tool call, given
        the action and its sealed arguments as the claim read them; the call
        is timed for the metrics when it started."""
        tool = self.registry.get(action["tool_name"])
        if tool is None:
            return ActionStatus.FAILED, {"error_code": "tool_unavailable"}, True, False
        if sealed is None:  # every write is stored with its arguments
            raise NotFoundError(f"no stored arguments for action {action['id']!r}")
        # Nothing is invoked if the arguments cannot be read or do not fit:
        # a definite failure, not an unknown.
        try:
            arguments = decrypt_arguments(sealed, associated_data=action["id"].encode())
        except (ArgumentsDecryptionError, ActionSecretKeyError) as exc:
            unreadable = {"error_code": "arguments_unreadable", "message": str(exc)}
            return ActionStatus.FAILED, unreadable, True, False
        try:
            parsed = tool.parse(arguments)
        except ToolArgumentsError as exc:  # schema messages may quote values
            message = redact_text(str(exc), arguments, action["safe_argument_fields"])
            invalid = {"error_code": "invalid_arguments", "message": message}
            return ActionStatus.FAILED, invalid, True, False
        context = ToolContext(
            run_id=action["run_id"],
            seat=action["agent_id"],
            action_id=action["id"],
            idempotency_key=action["idempotency_key"],
            fencing_token=action["fencing_token"],
        )

        async def hold() -> str | None:
            return await self.store.hold_action_lease(
                action["id"], action["fencing_token"], terms.lease_seconds
            )

        began = time.monotonic()
        with tool_span(tool.name, run_id=action["run_id"], action_id=action["id"]):
            outcome = await call_under_lease(lambda: tool.handler(parsed, context), terms, hold)
        status, result, over, interrupted = _judged(outcome, tool, arguments, action)
        if outcome.started:
            self.metrics.tool_call(tool.name, status, time.monotonic() - began)
        return status, result, over, interrupted

    async def _wake_waiters(self, action: dict[str, Any]) -> None:
        """Writes waiting for this action's target back off on timers that grow
        to minutes; a refresh signal makes them try again now. Best effort:
        the timers remain, and waking must never fail the write it follows."""
        if self.temporal is None:
            return
        try:
            runs = await self.store.runs_waiting_on_target(action)
            await asyncio.gather(*(nudge(self.temporal, run_id) for run_id in runs))
        except Exception as exc:
            log.warning("could not wake the writes waiting on %s's target: %s", action["id"], exc)

    async def _action_now(
        self, action_id: str, claim: ClaimOutcome | WriteEnd
    ) -> ExecuteWriteOutput:
        action = await self.store.get_action(action_id)
        return ExecuteWriteOutput(
            claim=claim,
            status=action["status"],
            result=await self._bounded(action, action["result"]),
        )

    async def _bounded(
        self, action: dict[str, Any], result: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        if result is None:
            return None
        return await bounded_result(
            self.store,
            run_id=action["run_id"],
            seat=action["agent_id"],
            call_id=action["logical_action_id"] or action["id"],
            content=result,
        )

    @activity.defn(name="withdraw_write")
    @typed_store_errors
    async def withdraw_write(self, ref: ActionRef) -> ExecuteWriteOutput:
        """The run is ending: a write still waiting or approved will not run."""
        bind(action_id=ref.action_id)
        action = await self.store.withdraw_action(ref.action_id, RUN_ENDED_REASON)
        return ExecuteWriteOutput(
            claim=WriteEnd.WITHDRAWN,
            status=action["status"],
            result=await self._bounded(action, action["result"]),
        )

    @activity.defn(name="withdraw_call")
    @typed_store_errors
    async def withdraw_call(self, ref: CallRef) -> str | None:
        """The run is ending while its write's intercept could not finish (no
        tool worker took it): if an earlier attempt recorded the write, it
        will not run. The action's status, or None when none was recorded."""
        action = await self.store.find_action_by_idempotency_key(ref.idempotency_key)
        if action is None or action["run_id"] != ref.run_id:
            return None
        bind(action_id=action["id"])
        return (await self.store.withdraw_action(action["id"], RUN_ENDED_REASON))["status"]

    @activity.defn(name="action_status")
    @typed_store_errors
    async def action_status(self, ref: ActionRef) -> ExecuteWriteOutput:
        """What the database says of an action now (e.g. reconciled directly)."""
        return await self._action_now(ref.action_id, WriteEnd.READ)

    @activity.defn(name="settle_write")
    @typed_store_errors
    async def settle_write(self, ref: ActionRef) -> ExecuteWriteOutput:
        """After execute_write failed (crash, timeout, lost heartbeat): the
        database decides. Still approved → never claimed, may run later.
        Executing → the tool may have run: unknown."""
        action_id = ref.action_id
        action = await self.store.get_action(action_id)
        if action["status"] == ActionStatus.EXECUTING:
            await self.store.record_action_terminal_result(
                action_id,
                ActionStatus.UNKNOWN,
                {"error_code": EXECUTION_INTERRUPTED},
                fencing_token=action["fencing_token"],
            )
        return await self._action_now(action_id, WriteEnd.SETTLED)

    @activity.defn(name="reconcile_for_run")
    @typed_store_errors
    async def reconcile_for_run(self, request: ReconcileRequest) -> ReconcileOutput:
        """Reconcile in the store an action of ``request.run_id`` (and only of it)."""
        action = await self.store.get_action(request.reconcile.action_id)
        if action["run_id"] != request.run_id:
            raise NotFoundError(f"action {action['id']!r} not found in run {request.run_id!r}")
        return await self.reconcile_action(request.reconcile)

    @activity.defn(name="reconcile_action")
    @typed_store_errors
    async def reconcile_action(self, inp: ReconcileInput) -> ReconcileOutput:
        action_id = inp.action_id

        async def run_of_the_action() -> str:
            return str((await self.store.get_action(action_id))["run_id"])

        return await self._telling_the_run_if_late(lambda: self._reconcile(inp), run_of_the_action)

    async def _reconcile(self, inp: ReconcileInput) -> ReconcileOutput:
        bind(action_id=inp.action_id)
        try:
            decider = verified_decider(inp, datetime.now(UTC))
        except AttestationExpiredError as stale:
            return await self._reconciled_despite_age(inp, stale)
        check_reconciler(decider)
        if not inp.request_id:
            # Its answer is kept under its request: one without could be
            # sent again, or answered with another's record.
            raise InvalidInputError("a reconciliation names its request (request_id)")
        conflict, retry_at = None, None
        try:
            fenced = None
            if inp.outcome == "failed":
                fenced = await _fence_target(self.store, self.registry, inp, self.tools_here)
            action = await self.store.reconcile_action(
                inp.action_id,
                inp.outcome,
                inp.decided_by,
                inp.note,
                fenced_below=fenced,
                request_id=inp.request_id,
                not_after=inp.not_after,
                asked_at=_asked_at(inp),
            )
        except ConflictError as exc:
            log_refusal("reconcile_action", CONFLICT, exc)
            action, conflict, retry_at = await self._refused(inp, exc)
        except Exception:
            # Committed, its answer lost (a connection dropped after COMMIT)?
            # Then it stands, and is this request's to be told of.
            mine = await self._own_record(inp, inp.decided_by)
            if mine is None:
                raise
            action = mine
        if conflict is None:
            await self._wake_waiters(action)  # the target is no longer blocked
        return ReconcileOutput(
            action_id=action["id"], status=action["status"], conflict=conflict, retry_at=retry_at
        )

    async def _own_record(
        self, inp: ReconcileInput, decided_by: str, locked: bool = False
    ) -> dict[str, Any] | None:
        return await self.store.reconciled_by_request(
            inp.action_id, inp.request_id, decided_by, inp.outcome, locked=locked
        )

    async def _reconciled_despite_age(
        self, inp: ReconcileInput, stale: AttestationExpiredError
    ) -> ReconcileOutput:
        """An attempt whose attestation is too old to make a change (one
        retried long after its first committed: a worker replaced, a store
        starved): its request's own record, read under the run lock behind
        any attempt still under way, for the operator the attestation
        (checked, whatever its age) names, is its answer. Without one it is
        refused as stale: nothing is first made with an expired word."""
        vouched = decider_whatever_its_age(inp)
        mine = None
        if vouched.role == "operator" and inp.request_id:
            mine = await self._own_record(inp, vouched.user_id, locked=True)
        if mine is None:
            raise stale
        await self._wake_waiters(mine)
        return ReconcileOutput(action_id=mine["id"], status=mine["status"])

    async def _refused(
        self, inp: ReconcileInput, refusal: ConflictError
    ) -> tuple[dict[str, Any], str | None, datetime | None]:
        """(the action, the conflict, when to retry) for a refused request:
        none when the reconciliation that stands is this request's own (an
        earlier attempt committed). A refusal for time is kept in the audit
        log; the request is refused for ever in any case, as asked while the
        attempt could run (``asked_at``), so a refusal that could not be kept
        is still the answer, not an error the activity would be retried on."""
        if isinstance(refusal, AttemptMayBeRunningError):
            try:
                stood = await self.store.refuse_reconcile(
                    inp.action_id, inp.request_id, inp.decided_by, inp.outcome, refusal.retry_at
                )
            except Exception as exc:
                log.warning(
                    "the refusal of reconciliation request %s could not be kept (%s)",
                    inp.request_id,
                    type(exc).__name__,
                )
                stood = None
            if stood is not None:
                return stood, None, None
            return await self.store.get_action(inp.action_id), str(refusal), refusal.retry_at
        mine = await self._own_record(inp, inp.decided_by)
        if mine is not None:
            return mine, None, None
        return await self.store.get_action(inp.action_id), str(refusal), None

    @activity.defn(name="reconciled_by_request")
    @typed_store_errors
    async def reconciled_by_request(self, inp: ReconcileInput) -> ReconcileOutput:
        """Whether the reconciliation that stands is this request's (a routed
        one whose activity failed may have committed all the same): the
        action's status, with a conflict unless it is. Only reads, so an
        attestation of any age names the operator; a message no attestation
        vouches for (a copy changed, a raw one) is told of nobody's record."""
        vouched = decider_whatever_its_age(inp)
        mine = None
        if vouched.role == "operator" and inp.request_id:
            # Under the run lock: a tool worker's transaction still under way
            # (its activity timed out while it was slow to commit) is waited for.
            mine = await self._own_record(inp, vouched.user_id, locked=True)
        if mine is not None:
            return ReconcileOutput(action_id=mine["id"], status=mine["status"])
        action = await self.store.get_action(inp.action_id)
        return ReconcileOutput(
            action_id=action["id"],
            status=action["status"],
            conflict=f"action {action['id']!r} is {action['status']}, not by this request",
        )


def _asked_at(inp: ReconcileInput) -> datetime | None:
    """When the request was asked: by the database's clock when its sender
    read it (operations.reconcile), else the attestation's time (the
    sender's clock: a wrong one moves the line by as much)."""
    if inp.asked_at is not None:
        return inp.asked_at
    return inp.attested_by.at if inp.attested_by is not None else None


def _external_id(result: dict[str, Any] | None) -> str | None:
    value = (result or {}).get("external_object_id")
    return str(value) if value is not None else None


def _refused_write(inp: InterceptInput, code: str, message: str) -> PendingWrite:
    return PendingWrite(
        action_id="",
        call_id=inp.call.id,
        seat=inp.seat,
        tool_name=inp.call.name,
        status=REFUSED,
        rejection=ToolOutcome(
            call_id=inp.call.id,
            tool_name=inp.call.name,
            status="error",
            content={"error_code": code, "message": message},
        ),
    )


# Under the local activity's own limit (workflows/timeouts.BOOKKEEPING, 30 s),
# so a fence that hangs is refused, not timed out and retried.
FENCE_WITHIN = timedelta(seconds=20)


def _redacted_error(exc: Exception, arguments: Any, safe_fields: Any) -> str:
    """An error's type and message, redacted of the arguments as a tool's
    errors are: what a tool or its system says may quote what it was given."""
    try:
        text = str(exc)
    except Exception:  # an error whose message cannot even be read
        text = "(its message could not be read)"
    return f"{type(exc).__name__}: {redact_text(text, arguments, safe_fields)}"


async def _fence_target(
    store: Store, registry: ToolRegistry, request: ReconcileInput, tools_here: bool = True
) -> int | None:
    """Before "it failed" is written down, make the tool refuse the attempt's
    write should it land late (a worker frozen past its lease): its token and
    any older one are fenced off. None when the tool cannot be fenced. On a
    worker without the tool refused: only one holding it can tell whether
    the tool fences, and skipping the fence would be a guess."""
    action_id = request.action_id
    action = await store.check_reconcilable(
        action_id, request.request_id, request.not_after, _asked_at(request)
    )
    tool = registry.get(action["tool_name"])
    if tool is None:
        # Whether it fences, and how, only a worker holding it can tell:
        # "failed" written unfenced here could be overtaken by a late write.
        where = "it runs on tool workers" if not tools_here else "this worker does not have it"
        raise ConflictError(
            f"{action['tool_name']} cannot be fenced here ({where}): reconcile this action "
            "as failed through a worker that has the tool (the API and CLI route it there)"
        )
    if tool is None or tool.fence is None or action["fencing_token"] is None:
        return None
    try:
        arguments = await store.get_action_arguments(action_id)
    except (ArgumentsDecryptionError, ActionSecretKeyError) as exc:  # no retry opens them
        raise ConflictError(
            f"{action['tool_name']} cannot be fenced: its arguments cannot be opened here "
            f"({exc}); nothing was recorded"
        ) from None
    attempt = ToolContext(
        run_id=action["run_id"],
        seat=action["agent_id"],
        action_id=action_id,
        idempotency_key=action["idempotency_key"],
        fencing_token=action["fencing_token"],
    )
    # Answered at once, not retried: a fence that fails or does not answer
    # is a refusal that recorded nothing, and the operator asks again.
    said = None
    try:
        async with asyncio.timeout(FENCE_WITHIN.total_seconds()):
            applied_nothing = await tool.fence(tool.parse(arguments), attempt)
    except TimeoutError:
        said = f"no answer within {FENCE_WITHIN.total_seconds():.0f} s"
    except Exception as exc:
        said = _redacted_error(exc, arguments, action["safe_argument_fields"])
    if said is not None:  # raised out here, it carries no trace of the error
        raise ConflictError(
            f"{action['tool_name']}'s fence failed, so nothing was recorded ({said}); "
            "reconcile again once the tool's system answers"
        )
    if not applied_nothing:
        raise ConflictError(
            f"{action['tool_name']}'s own log shows this write applied: reconcile it as succeeded"
        )
    return action["fencing_token"] + 1


def _recorded(decided: dict[str, Any], **more: Any) -> DecisionRecorded:
    """A decision as its transaction recorded it (the approval as decided,
    with its action's status): what the workflow is told."""
    return DecisionRecorded(
        approval_id=decided["id"],
        action_id=decided["action_id"],
        status=decided["action_status"],
        approval_status=decided["status"],
        expires_at=decided["expires_at"],
        **more,
    )


def _tighter(asked: int | None, ours: int) -> int:
    return ours if asked is None else min(asked, ours)


def _tenant_of(tool: ToolDefinition, arguments: dict[str, Any]) -> Any:
    """The tenant a write names, or None for a tool without tenants."""
    return arguments.get(tool.tenant_field) if tool.tenant_field else None


def _call_refusal(inp: InterceptInput, spec: Any) -> PendingWrite | None:
    if spec is None:
        return _refused_write(inp, "unknown_tool", f"no tool named {inp.call.name!r} in this run")
    if not inp.snapshot.granted(inp.seat, inp.call.name):
        return _refused_write(
            inp, "tool_not_granted", f"{inp.call.name} is not granted to {inp.seat}"
        )
    if spec.side_effect != "write":
        return _refused_write(inp, "not_a_write", f"{inp.call.name} is not a write tool")
    return None


def _judged(
    outcome: CallOutcome, tool: ToolDefinition, arguments: dict[str, Any], action: dict[str, Any]
) -> tuple[str, dict[str, Any], bool, bool]:
    """(status, result, attempt over, interrupted): how one tool call ended,
    judged case by case in one place."""
    if not outcome.started:  # the lease was in doubt before the call: nothing ran
        failure = {"error_code": "lease_lost_before_start", "reason": outcome.lease_lost}
        return ActionStatus.FAILED, failure, True, False
    # Only a tool whose effects end with its call is over when the call is.
    over = outcome.finished and tool.effects_end_with_call
    said = redact_text(str(outcome.error or ""), arguments, action["safe_argument_fields"])
    if outcome.stopped:
        code = LEASE_LOST if outcome.lease_lost else EXECUTION_INTERRUPTED
        result = {"error_code": code}
        if outcome.lease_lost:
            result["reason"] = outcome.lease_lost
        if not outcome.finished:
            result["tool_call_abandoned"] = True  # it ignored cancellation
        return ActionStatus.UNKNOWN, result, over, outcome.interrupted
    if outcome.error is None:
        # What the tool answered is stored in plain text, shown by the API and
        # given to the agents: whatever of the arguments it echoes is redacted.
        shown = redact_result(outcome.result, arguments, action["safe_argument_fields"])
        return ActionStatus.SUCCEEDED, shown, True, False
    if isinstance(outcome.error, ToolDefiniteFailure):
        # The code is the tool's too (stored, audited, shown): redacted alike.
        code = redact_text(str(outcome.error.code), arguments, action["safe_argument_fields"])
        failure = {"error_code": code, "message": said}
        return ActionStatus.FAILED, failure, True, False
    # Any other error: the tool may or may not have acted. Keep what it
    # said (redacted of the arguments) for whoever reconciles it.
    unknown = {
        "error_code": "tool_error",
        "error_type": type(outcome.error).__name__,
        "message": said,
    }
    return ActionStatus.UNKNOWN, unknown, over, False
