"""Activities on the write path: intercept, decide, expire, execute, settle, reconcile.

Only ``execute_write`` touches the outside world, and it never retries: it
claims the target lease, invokes the tool once while heartbeating and renewing
the lease, and records the result. Everything else is idempotent bookkeeping
that may run as a local activity.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from temporalio import activity
from temporalio.client import Client

from activities.errors import typed_store_errors
from roundtable.models import (
    ActionRef,
    ApprovalRef,
    DecideRequest,
    DecisionOutput,
    ExecuteWriteInput,
    ExecuteWriteOutput,
    ExtendInput,
    ExtendOutput,
    InterceptInput,
    PendingWrite,
    ReconcileInput,
    ReconcileOutput,
    SignalSender,
    ToolOutcome,
)
from roundtable.security import CapabilityError, derive_target
from roundtable.store import ClaimOutcome, ConflictError, InvalidInputError, Store
from roundtable.store.states import ActionStatus
from roundtable.tools.policy import initial_action_status
from roundtable.tools.registry import (
    ToolArgumentsError,
    ToolContext,
    ToolDefiniteFailure,
    ToolRegistry,
)

EXECUTION_INTERRUPTED = "execution_interrupted"


class WriteActivities:
    def __init__(
        self, store: Store, registry: ToolRegistry, temporal: Client | None = None
    ) -> None:
        self.store = store
        self.registry = registry
        self.temporal = temporal  # to read who sent a signal, from the history

    @activity.defn(name="signal_sender")
    async def signal_sender(self, inp: SignalSender) -> str | None:
        """The Temporal identity that sent the newest matching signal. The SDK
        does not hand it to signal handlers, but the history records it."""
        if self.temporal is None:
            return None
        history = await self.temporal.get_workflow_handle(inp.workflow_id).fetch_history()
        converter = self.temporal.data_converter
        for event in reversed(history.events):
            if not event.HasField("workflow_execution_signaled_event_attributes"):
                continue
            signalled = event.workflow_execution_signaled_event_attributes
            if signalled.signal_name != inp.signal_name:
                continue
            (payload,) = await converter.decode(list(signalled.input.payloads), [dict])
            subject = payload.get("approval_id") or payload.get("action_id")
            if subject == inp.subject_id:
                return signalled.identity or None
        return None

    # ----------------------------------------------------------------- intercept

    @activity.defn(name="intercept_write")
    @typed_store_errors
    async def intercept_write(self, inp: InterceptInput) -> PendingWrite:
        """Turn a write tool call into a persisted action (and approval).
        The idempotency key comes from run, seat, round and call id, so running
        this twice yields one action."""
        call, spec = inp.call, inp.snapshot.tool(inp.call.name)
        refused = _refusal(inp, spec)
        if refused is not None:
            return refused
        tool = self.registry.get(call.name)
        try:
            if tool is None:
                raise ToolArgumentsError(f"{call.name} is not available on this worker")
            arguments = tool.normalize(call.arguments)
            target = derive_target(call.name, arguments, inp.snapshot.model_dump(), inp.seat)
        except (ToolArgumentsError, CapabilityError) as exc:
            return _refused(inp, "invalid_arguments", str(exc))
        status = initial_action_status(inp.write_policy, spec.risk_level)
        action = await self.store.create_action(
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
            }
        )
        approval = (
            await self.store.get_approval(action["approval_id"]) if action["approval_id"] else None
        )
        return PendingWrite(
            action_id=action["id"],
            call_id=call.id,
            seat=inp.seat,
            tool_name=call.name,
            status=action["status"],
            approval_id=action["approval_id"],
            approval_deadline=approval["expires_at"] if approval else None,
        )

    # ----------------------------------------------------------------- decisions

    @activity.defn(name="decide_approval")
    @typed_store_errors
    async def decide_approval(self, request: DecideRequest) -> DecisionOutput:
        """Compare-and-set the decision. A conflict is reported with the
        approval's real status, so the workflow follows the database."""
        inp = request.decision
        if inp.arguments is not None:
            return await self._approve_with_edits(request)
        try:
            await self.store.decide_approval(
                inp.approval_id, inp.decision, inp.decided_by, inp.reason, inp.arguments_digest
            )
            return await self._decision_view(inp.approval_id)
        except ConflictError as exc:
            return await self._decision_view(inp.approval_id, conflict=str(exc))

    async def _approve_with_edits(self, request: DecideRequest) -> DecisionOutput:
        """Edited arguments meet every check the original ones met: the tool's
        schema, the run's write policy and grants, a freshly derived target."""
        inp = request.decision
        action = await self.store.get_action(
            (await self.store.get_approval(inp.approval_id))["action_id"]
        )
        tool = self.registry.get(action["tool_name"])
        if tool is None or request.snapshot is None:
            raise InvalidInputError(f"{action['tool_name']} cannot be re-validated here")
        try:
            arguments = tool.normalize(inp.arguments or {})
            target = derive_target(
                action["tool_name"], arguments, request.snapshot.model_dump(), action["agent_id"]
            )
        except (ToolArgumentsError, CapabilityError) as exc:
            raise InvalidInputError(f"edited arguments refused: {exc}") from exc
        if initial_action_status(request.write_policy, action["risk_level"]) == (
            ActionStatus.REJECTED
        ):
            raise InvalidInputError("the run's write policy refuses this write")
        try:
            _, changes = await self.store.approve_with_edits(
                inp.approval_id,
                inp.decided_by,
                inp.reason,
                inp.arguments_digest,
                arguments,
                target,
            )
        except ConflictError as exc:
            return await self._decision_view(inp.approval_id, conflict=str(exc))
        view = await self._decision_view(inp.approval_id)
        view.edits = changes
        return view

    @activity.defn(name="expire_approval")
    @typed_store_errors
    async def expire_approval(self, ref: ApprovalRef) -> DecisionOutput:
        """The workflow's deadline timer fired: expire unless a decision won."""
        await self.store.expire_approval(ref.approval_id)
        return await self._decision_view(ref.approval_id)

    @activity.defn(name="approval_status")
    @typed_store_errors
    async def approval_status(self, ref: ApprovalRef) -> DecisionOutput:
        return await self._decision_view(ref.approval_id)

    @activity.defn(name="extend_approval")
    @typed_store_errors
    async def extend_approval(self, inp: ExtendInput) -> ExtendOutput:
        approval = await self.store.extend_approval(
            inp.approval_id, inp.seconds, inp.extended_by, inp.max_seconds
        )
        return ExtendOutput(approval_id=approval["id"], expires_at=approval["expires_at"])

    async def _decision_view(self, approval_id: str, conflict: str | None = None) -> DecisionOutput:
        approval = await self.store.get_approval(approval_id)
        action = await self.store.get_action(approval["action_id"])
        return DecisionOutput(
            approval_id=approval_id,
            action_id=action["id"],
            status=action["status"],
            approval_status=approval["status"],
            conflict=conflict,
        )

    # ----------------------------------------------------------------- execution

    @activity.defn(name="execute_write")
    @typed_store_errors
    async def execute_write(self, inp: ExecuteWriteInput) -> ExecuteWriteOutput:
        """Claim, invoke once, record. Runs with maximum_attempts=1."""
        claim = await self.store.claim_action_for_execution(inp.action_id, inp.lease_seconds)
        if claim != ClaimOutcome.CLAIMED:
            return await self._report(inp.action_id, claim)
        action = await self.store.get_action(inp.action_id)
        token = action["fencing_token"]
        status, result = await self._invoke_under_lease(action, inp)
        await self.store.record_action_terminal_result(
            inp.action_id,
            status,
            result,
            fencing_token=token,
            external_object_id=_external_id(result),
        )
        # Report what the database says: recovery may have made it unknown first.
        return await self._report(inp.action_id, claim)

    async def _invoke_under_lease(
        self, action: dict[str, Any], inp: ExecuteWriteInput
    ) -> tuple[str, dict[str, Any]]:
        tool = self.registry.get(action["tool_name"])
        if tool is None:
            return ActionStatus.FAILED, {"error_code": "tool_unavailable"}
        try:
            parsed = tool.parse(await self.store.get_action_arguments(action["id"]))
        except ToolArgumentsError as exc:
            return ActionStatus.FAILED, {"error_code": "invalid_arguments", "message": str(exc)}
        context = ToolContext(
            run_id=action["run_id"],
            seat=action["agent_id"],
            action_id=action["id"],
            idempotency_key=action["idempotency_key"],
            fencing_token=action["fencing_token"],
        )
        keeper = asyncio.create_task(self._keep_lease(action, inp))
        try:
            result = await tool.handler(parsed, context)
            return ActionStatus.SUCCEEDED, result
        except ToolDefiniteFailure as exc:
            return ActionStatus.FAILED, {"error_code": exc.code, "message": str(exc)}
        except asyncio.CancelledError:
            # Cancelled mid-call (heartbeat timeout, worker shutdown): the tool
            # may have acted. Record unknown, best effort, then let go.
            with contextlib.suppress(Exception):
                await self.store.record_action_terminal_result(
                    action["id"],
                    ActionStatus.UNKNOWN,
                    {"error_code": EXECUTION_INTERRUPTED},
                    fencing_token=action["fencing_token"],
                )
            raise
        except Exception as exc:  # the tool may or may not have acted
            return ActionStatus.UNKNOWN, {
                "error_code": "tool_error",
                "error_type": type(exc).__name__,
            }
        finally:
            keeper.cancel()

    async def _keep_lease(self, action: dict[str, Any], inp: ExecuteWriteInput) -> None:
        """Heartbeat and renew the lease; stop renewing once it is lost."""
        while True:
            await asyncio.sleep(inp.heartbeat_interval_seconds)
            activity.heartbeat()
            renewed = await self.store.renew_action_lease(
                action["id"], action["fencing_token"], inp.lease_seconds
            )
            if not renewed:
                activity.logger.warning("lease of action %s is lost", action["id"])
                return

    async def _report(self, action_id: str, claim: str) -> ExecuteWriteOutput:
        action = await self.store.get_action(action_id)
        return ExecuteWriteOutput(claim=claim, status=action["status"], result=action["result"])

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
        return await self._report(action_id, "settled")

    @activity.defn(name="reconcile_action")
    @typed_store_errors
    async def reconcile_action(self, inp: ReconcileInput) -> ReconcileOutput:
        try:
            action = await self.store.reconcile_action(
                inp.action_id, inp.outcome, inp.decided_by, inp.note
            )
            conflict = None
        except ConflictError as exc:
            action, conflict = await self.store.get_action(inp.action_id), str(exc)
        return ReconcileOutput(action_id=action["id"], status=action["status"], conflict=conflict)


def _external_id(result: dict[str, Any] | None) -> str | None:
    value = (result or {}).get("external_object_id")
    return str(value) if value is not None else None


def _refused(inp: InterceptInput, code: str, message: str) -> PendingWrite:
    return PendingWrite(
        action_id="",
        call_id=inp.call.id,
        seat=inp.seat,
        tool_name=inp.call.name,
        status="refused",
        rejection=ToolOutcome(
            call_id=inp.call.id,
            tool_name=inp.call.name,
            status="error",
            content={"error_code": code, "message": message},
        ),
    )


def _refusal(inp: InterceptInput, spec: Any) -> PendingWrite | None:
    if spec is None:
        return _refused(inp, "unknown_tool", f"no tool named {inp.call.name!r} in this run")
    if not inp.snapshot.granted(inp.seat, inp.call.name):
        return _refused(inp, "tool_not_granted", f"{inp.call.name} is not granted to {inp.seat}")
    if spec.side_effect != "write":
        return _refused(inp, "not_a_write", f"{inp.call.name} is not a write tool")
    return None
