"""RoundtableWorkflow: rounds of seats, their tool calls, the run's ending,
and its messages (each write is steered by workflows/write_path.py).

The database is the ledger; this workflow is the conductor. It never writes a
status itself: every transition is an activity against the store, and when an
activity's fate is unclear the store, not the error, decides what happened.
(Over 400 lines: the message handlers must be methods of the workflow class.)
"""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.exceptions import TimeoutError as TemporalTimeout

with workflow.unsafe.imports_passed_through():
    from activities.run_activities import RunActivities
    from activities.write_activities import WriteActivities
    from roundtable.context_budget import fit_context
    from roundtable.models import (
        CallRef,
        ChatMessage,
        Decision,
        EnsureRunInput,
        ExtendInput,
        ExtendOutput,
        InterceptInput,
        PendingWrite,
        ReadToolInput,
        ReconcileInput,
        RecordDecisionInput,
        RunInput,
        RunResult,
        RunState,
        SignalSender,
        TakeTurnInput,
        ToolCall,
        ToolOutcome,
        ToolSpec,
        WorkflowArgs,
    )
    from roundtable.names import (
        ATTEMPT_MAY_BE_RUNNING,
        CONFLICT,
        DECIDE_UPDATE,
        DECISION_SIGNAL,
        EXTEND_UPDATE,
        KEYED_ATTEMPT,
        NOT_TRACKED,
        RECONCILE_SIGNAL,
        RECONCILE_UPDATE,
        REFRESH_SIGNAL,
        RUN_WORKFLOW,
        STATE_QUERY,
    )
    from roundtable.shared_snapshots import shared_snapshot
    from roundtable.states import REFUSED, ApprovalStatus

# The run's helpers are imported as the module is, not passed through: where
# a sandbox runs this module (the strict replay tests; the worker runs none,
# roundtable/workflow_runner.py) its restrictions watch them too.
from workflows.notifier import Notifier
from workflows.routing import GaveUp, ToolRoutes, final
from workflows.status import StatusBoard
from workflows.timeouts import BOOKKEEPING, MODEL_CALL, TOOL_CALL
from workflows.write_path import SETTLED, Inbox, WritePath

# Runs started before the safety-holes fixes keep their old behaviour to the
# end (their histories must replay); runs started after take the new rules.
# See Inbox.new_rules (workflows/write_path.py) and run() for where the two differ.
SAFETY_RULES_PATCH = "safety-rules-v1"
# Runs that reach the end after this change wait for every message handler
# still running (a raw signal's sender lookup, say) before they complete.
HANDLERS_DONE_PATCH = "handlers-finish-before-completion"
# Runs started after this change let a write's intercept and its decision
# carry the run's status in their own transactions (workflows/status.py):
# two local activities and two history events fewer per approved write.
LEAN_STATUS_PATCH = "status-carried-by-writes"
# Runs started after this change retry a write waiting for its target as soon
# as a refresh says the target freed, instead of only when its timer fires.
WAKE_WAITERS_PATCH = "writes-wake-when-target-frees"
# Runs started after this change let only fired timers say an approval's
# warning or deadline has come, and arm a timer for every wait: workflow.now()
# chooses no command (workflows/approval_clock.py). Older runs let the clock
# choose, and a worker that read another clock than the history's could not
# replay them (tests/histories_nondeterministic/, tests/test_replay_clock.py).
TIMERS_DECIDE_PATCH = "approval-times-decided-by-timers"
# Runs started after this change record this one marker instead of asking for
# each patch above (and write_path's per-write-blocked-reasons) one by one:
# it stands for all of them. Each patch a run asks for costs two commands and
# two history events (its marker and the SDK's upsert of TemporalChangeVersion)
# and two of the SDK core's state machines held while the run is cached; six
# of them were twelve a run. Runs without it (started before) ask for each
# patch as they always did, so their histories replay unchanged.
CURRENT_RULES_PATCH = "rules-as-of-2026-12"
# A decision whose activity failed on a tool worker asks the store for its
# own request's record and the approval's edits (workflows/write_path.py,
# request_decision) where it used to ask only for the approval's status: a
# decision another person recorded in the meantime was answered as the
# caller's own when both asked for the same status, and edits that stood
# were never told to the seat. Asked only on that path, so only runs that
# took it carry the marker; the SDK keeps a run's first answer for the whole
# run, so a run that took the old path before the deploy keeps it for its
# later decisions too.
DECISION_BY_REQUEST_PATCH = "decision-fallback-by-request"
# The same for a reconciliation whose activity failed on a tool worker: it
# asks the store whether this request's reconciliation is the one recorded
# (WriteActivities.reconciled_by_request) where it used to take any recorded
# outcome equal to the one asked for as the caller's, so a second operator
# was told they had reconciled what the first one had.
RECONCILE_BY_REQUEST_PATCH = "reconcile-fallback-by-request"


@workflow.defn(name=RUN_WORKFLOW)
class RoundtableWorkflow:
    @workflow.init
    def __init__(self, args: WorkflowArgs) -> None:
        self.request: RunInput = args.request
        # What the worker checks the run's grant against; the request never
        # changes, so it is hashed once, not at every write.
        self._fingerprint = args.request.fingerprint()
        self.state: RunState = args.carried or RunState(run_id=args.request.run_id or "")
        # Snapshots of one value are one object across the worker's runs (memory per
        # waiting run; roundtable/shared_snapshots.py says why that is safe).
        self.state.snapshot = shared_snapshot(self.state.snapshot)
        self._inbox = Inbox()  # what messages and the run's ending tell its writes
        self._status = StatusBoard(
            self.state, self.request, decided=lambda a: a in self._inbox.after_decision
        )
        self._notifier = Notifier(self.state)
        self._routes = ToolRoutes(self.state, self.request, self._status.publish)
        self._writes = WritePath(
            self.state, self.request, self._inbox, self._status, self._notifier, self._routes
        )
        self._tasks: list[asyncio.Task] = []  # every seat turn and tool call
        # Model turns and reads under way, in the order they started: a set
        # of handles (hashed by address) would cancel them in an order that
        # differs between the worker that ran the run and one replaying it.
        self._interruptible: dict = {}

    # ================================================================= the process

    @workflow.run
    async def run(self, args: WorkflowArgs) -> RunResult:
        # Where the new rules differ from the old (each guarded by this flag):
        # writes met again in any state; decisions and expiry follow the
        # database; reconciliation re-read on refresh; a run ending early
        # settles its writes; a withdrawn write ends the busy-target loop.
        if workflow.patched(CURRENT_RULES_PATCH):
            self._inbox.current_rules = True
            self._inbox.new_rules = self._status.lean = True
            self._inbox.wakes_on_refresh = self._inbox.timers_decide = True
        else:
            self._inbox.new_rules = workflow.patched(SAFETY_RULES_PATCH)
            self._status.lean = self._inbox.new_rules and workflow.patched(LEAN_STATUS_PATCH)
            self._inbox.wakes_on_refresh = self._inbox.new_rules and workflow.patched(
                WAKE_WAITERS_PATCH
            )
            self._inbox.timers_decide = self._inbox.new_rules and workflow.patched(
                TIMERS_DECIDE_PATCH
            )
        self.state.reads_store_on_refresh = self._inbox.new_rules
        try:
            if args.carried is None:
                await self._open_run()
            await self._status.publish()
            while self.state.round < self.request.max_rounds:
                await self._play_round(self.state.round + 1)
                self.state.round += 1
                if workflow.info().is_continue_as_new_suggested():
                    await self._notifier.done()
                    await workflow.wait_condition(workflow.all_handlers_finished)
                    workflow.continue_as_new(WorkflowArgs(request=self.request, carried=self.state))
            await self._conclude()
            if self._inbox.current_rules or workflow.patched(HANDLERS_DONE_PATCH):
                await workflow.wait_condition(workflow.all_handlers_finished)
        except (ActivityError, ApplicationError) as exc:
            # Regular activities fail as ActivityError, local ones as their own
            # ApplicationError: either way the store must say the run failed.
            if not self._inbox.new_rules:
                await self._finish("failed")
                raise
            await self._end_early("failed", _failure_of(exc))
            raise
        except asyncio.CancelledError:
            if not self._inbox.new_rules:
                await self._finish("cancelled")
                raise
            await self._end_early("cancelled", None)
            raise
        return RunResult(
            run_id=self.state.run_id,
            status=self.state.status,
            final_answer=self.state.final_answer,
            usage=self.state.usage,
        )

    async def _open_run(self) -> None:
        inp = EnsureRunInput(
            run_id=self.state.run_id,
            user_id=self.request.user_id,
            task_text=self.request.task_text,
            seats=self.request.seats,
            tools=self.request.tools,
            seat_tools=self.request.seat_tools,
            write_policy=self.request.write_policy,
            models=sorted(self.request.models()),
            request_fingerprint=self._fingerprint,
        )
        if self._inbox.current_rules:
            # A local activity, as the run's other bookkeeping is: one marker
            # in the first task instead of an activity's three events and the
            # task after it (idempotent: creates the rows once, on the worker
            # that runs the workflow, as the activity did on its queue). It
            # carries the run's first status, "running", in the transaction
            # that pins the snapshot: the first publish writes no status.
            async with self._status.carrying():
                opened = await workflow.execute_local_activity_method(
                    RunActivities.ensure_run,
                    inp.model_copy(update={"open_as": "running", "keep_snapshot": True}),
                    start_to_close_timeout=BOOKKEEPING,
                    summary="open run",
                )
                self._status.told(opened.run_status)
        else:
            opened = await workflow.execute_activity_method(
                RunActivities.ensure_run,
                inp,
                start_to_close_timeout=BOOKKEEPING,
                summary="open run",
            )
        self.state.session_id = opened.session_id
        self.state.snapshot = shared_snapshot(opened.snapshot)
        self.state.webhook_urls = opened.webhook_urls
        self.state.expiring_lead_seconds = opened.expiring_lead_seconds
        self.state.tool_queues = opened.tool_queues
        # Kept in the store: the seat turns name it instead of carrying specs.
        self.state.snapshot_digest = opened.snapshot_digest
        self.state.threads = {seat: [] for seat in self.request.seats}
        self.state.status = "running"

    async def _play_round(self, round_number: int) -> None:
        if self.request.mode == "parallel":
            # Everyone speaks at once, seeing only what was said before the round.
            heard = list(self.state.transcript)
            await self._all(
                self._seat_turn(seat, round_number, heard) for seat in self.request.seats
            )
        else:
            for seat in self.request.seats:
                await self._all([self._seat_turn(seat, round_number, None)])

    async def _all(self, coroutines) -> list:  # type: ignore[no-untyped-def]
        """Run these as tracked tasks and wait for all; the first failure is
        raised. The tasks are never cancelled with the caller: a run that ends
        early winds each of them down (see _end_early) instead of abandoning
        a write mid-flight."""
        tasks = [asyncio.ensure_future(c) for c in coroutines]
        if not tasks:
            return []
        self._tasks.extend(tasks)
        try:
            await workflow.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            if not self._inbox.new_rules:  # as asyncio.gather and a plain await did
                for task in tasks:
                    task.cancel()
            raise
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]

    async def _interruptible_activity(self, activity, argument, **options):  # type: ignore[no-untyped-def]
        """A side-effect-free activity (a model turn, a read) that a run ending
        early may cancel."""
        handle = workflow.start_activity_method(activity, argument, **options)
        self._interruptible[handle] = None
        try:
            return await handle
        finally:
            self._interruptible.pop(handle, None)

    async def _seat_turn(self, seat: str, round_number: int, heard: list | None) -> None:
        if self._inbox.ending:
            return
        thread = self.state.threads.setdefault(seat, [])
        transcript = self.state.transcript if heard is None else heard
        turn = await self._interruptible_activity(
            RunActivities.take_turn,
            TakeTurnInput(
                run_id=self.state.run_id,
                seat=seat,
                round=round_number,
                role="seat",
                model=self.request.seat_models.get(seat, self.request.model),
                task_text=self.request.task_text,
                role_prompt=self.request.seat_roles.get(seat),
                reasoning_effort=self.request.reasoning_effort,
                thread=thread,
                others=_since_last_turn(transcript, seat),
                tools=self._carried_tools(seat),
                tools_of=self.state.snapshot_digest,
                script=self.request.script,
                chain=workflow.info().first_execution_run_id,
            ),
            start_to_close_timeout=MODEL_CALL,
            summary=f"turn of {seat} in round {round_number}",
        )
        self.state.usage = self.state.usage.plus(turn.response.usage)
        thread.extend(turn.new_messages)
        self.state.transcript.append(
            ChatMessage(role="user", name=seat, content=turn.response.text)
        )
        outcomes = await self._run_tool_calls(seat, round_number, turn.response.tool_calls)
        thread.extend(
            ChatMessage(
                role="tool",
                tool_call_id=o.call_id,
                name=o.tool_name,
                content=json.dumps({"outcome": o.status, "result": o.content}, default=str),
            )
            for o in outcomes
        )
        # Everything a seat hears is carried from here on: keep the sum bounded.
        fit_context(self.state.threads, self.state.transcript)

    async def _run_tool_calls(
        self, seat: str, round_number: int, calls: list[ToolCall]
    ) -> list[ToolOutcome]:
        return await self._all(self._tool_call(seat, round_number, c) for c in calls)

    async def _tool_call(self, seat: str, round_number: int, call: ToolCall) -> ToolOutcome:
        if self._inbox.ending:  # the run is winding down: start nothing new
            return _run_ended(call)
        if call.malformed:  # the model's call could not be read: tell it, run nothing
            return ToolOutcome(
                call_id=call.id,
                tool_name=call.name,
                status="error",
                content={"error_code": "malformed_call", "message": call.malformed},
            )
        spec = self.state.snapshot.tool(call.name) if self.state.snapshot else None
        if (
            spec is not None
            and spec.side_effect == "read"
            and self.state.snapshot.granted(seat, call.name)
        ):

            def read(routed: dict, prior_attempt: bool):  # type: ignore[no-untyped-def]
                return self._interruptible_activity(
                    RunActivities.run_read_tool,
                    ReadToolInput(
                        run_id=self.state.run_id,
                        seat=seat,
                        call=call,
                        prior_attempt=prior_attempt,
                    ),
                    start_to_close_timeout=TOOL_CALL,
                    summary=f"read {call.name} for {seat}",
                    **routed,
                )

            try:
                key = f"{seat}:r{round_number}:{call.id}"
                return await self._routes.until_served(
                    call.name, key, read, lambda: bool(self._inbox.ending)
                )
            except GaveUp:  # waited for a tool worker until the run ended
                return _run_ended(call)
        async with self._status.carrying():
            pending = await self._intercept(
                seat,
                InterceptInput(
                    run_id=self.state.run_id,
                    session_id=self.state.session_id,
                    seat=seat,
                    round=round_number,
                    call=call,
                    snapshot=self.state.snapshot,
                    write_policy=self.request.write_policy,
                    approval_deadline=workflow.now()
                    + timedelta(seconds=self.request.approval_timeout_seconds),
                    request_fingerprint=self._fingerprint,
                    run_status_while_waiting=self._status.while_waiting(),
                ),
                summary=f"intercept {call.name} from {seat}",
            )
            self._status.told(pending.run_status)
        return await self._writes.steer(pending)

    async def _intercept(self, seat: str, inp: InterceptInput, summary: str) -> PendingWrite:
        """Record a write: a local activity, or on the tool's own worker when
        tool workers serve it (only they hold its code). Waiting for one, the
        approval's deadline is counted from each attempt, and a run that ends
        meanwhile withdraws whatever an attempt may have recorded."""
        call = inp.call
        if self._routes.queue(call.name) is None:
            return await workflow.execute_local_activity_method(
                WriteActivities.intercept_write,
                inp,
                start_to_close_timeout=BOOKKEEPING,
                summary=summary,
            )
        timeout = timedelta(seconds=self.request.approval_timeout_seconds)

        def attempt(routed: dict, _prior: bool):  # type: ignore[no-untyped-def]
            # Idempotent (keyed by run, seat, round and call): may run again.
            fresh = inp.model_copy(update={"approval_deadline": workflow.now() + timeout})
            return self._interruptible_activity(
                WriteActivities.intercept_write,
                fresh,
                start_to_close_timeout=BOOKKEEPING,
                summary=summary,
                **routed,
            )

        key = f"{inp.run_id}:{seat}:r{inp.round}:{call.id}"
        try:
            return await self._routes.until_served(
                call.name, key, attempt, lambda: bool(self._inbox.ending)
            )
        except (GaveUp, ActivityError) as exc:
            if not self._inbox.ending:
                raise
            # The run is ending: an attempt may have recorded the write before
            # its worker was lost; it will not run.
            await workflow.execute_local_activity_method(
                WriteActivities.withdraw_call,
                CallRef(run_id=inp.run_id, idempotency_key=key),
                start_to_close_timeout=BOOKKEEPING,
                summary="withdraw write: the run is ending",
            )
            workflow.logger.info("intercept of %s given up: %s", call.name, exc)
            return PendingWrite(
                action_id="",
                call_id=call.id,
                seat=seat,
                tool_name=call.name,
                status=REFUSED,
                rejection=_run_ended(call),
            )

    # ================================================================= ending

    def _carried_tools(self, seat: str) -> list[ToolSpec]:
        """The tool specs a seat's turn carries: none when the store keeps
        the run's snapshot (the turn names its digest, ``tools_of``); runs
        opened before that send them every turn."""
        if self.state.snapshot_digest is not None or self.state.snapshot is None:
            return []
        return self.state.snapshot.tools_for(seat)

    async def _conclude(self) -> None:
        if self.request.manager:
            turn = await workflow.execute_activity_method(
                RunActivities.take_turn,
                TakeTurnInput(
                    run_id=self.state.run_id,
                    seat=self.request.manager,
                    round=self.state.round,
                    role="manager",
                    model=self.request.seat_models.get(self.request.manager, self.request.model),
                    reasoning_effort=self.request.reasoning_effort,
                    task_text=self.request.task_text,
                    others=self.state.transcript,
                    script=self.request.script,
                    chain=workflow.info().first_execution_run_id,
                ),
                start_to_close_timeout=MODEL_CALL,
                summary="manager writes the final answer",
            )
            self.state.usage = self.state.usage.plus(turn.response.usage)
            self.state.final_answer = turn.response.text
        elif self.state.transcript:
            self.state.final_answer = self.state.transcript[-1].content
        await self._finish("completed")
        self._notifier.notify("run.completed", self.state.run_id, {"status": "completed"})
        await self._notifier.done()

    async def _end_early(self, status: str, failure: dict[str, str] | None) -> None:
        """The run failed or was cancelled. It ends only once every seat's
        writes are settled: model turns and reads are cancelled, writes under
        way run to a recorded outcome, approvals still open are withdrawn and
        unclaimed writes rejected (run_ended)."""
        self._inbox.ending = status
        for handle in list(self._interruptible):
            handle.cancel()
        while any(not task.done() for task in self._tasks):
            await workflow.wait([t for t in self._tasks if not t.done()])
        for task in self._tasks:  # their failures are the run's failure, already told
            if not task.cancelled():
                task.exception()
        await workflow.wait_condition(workflow.all_handlers_finished)
        self._status.failure = failure
        try:
            await self._finish(status)
        except (ActivityError, ApplicationError) as exc:
            # The store could not be told (e.g. the run row was never made):
            # the sweep settles runs whose workflow closed.
            workflow.logger.warning("could not record the run as %s: %s", status, exc)

    async def _finish(self, status: str) -> None:
        self.state.status = status
        await self._status.publish(force=True)

    # ================================================================= messages

    async def _handler_activity(self, activity, argument, summary: str, tool: str | None = None):  # type: ignore[no-untyped-def]
        """A local activity for a message handler (on ``tool``'s own worker
        when tool workers serve it); its failure always reaches the handler
        as an ApplicationError of the activity's type (a local activity's
        failure may arrive as that error itself or wrapped in an ActivityError),
        so an update's caller sees why and a signal handler can log and go on."""
        try:
            if tool is None or self._routes.queue(tool) is None:
                return await workflow.execute_local_activity_method(
                    activity, argument, start_to_close_timeout=BOOKKEEPING, summary=summary
                )
            return await self._routes.once(
                tool,
                lambda routed: workflow.execute_activity_method(
                    activity,
                    argument,
                    start_to_close_timeout=BOOKKEEPING,
                    summary=summary,
                    **routed,
                ),
            )
        except ActivityError as exc:
            cause = exc.cause
            kind = cause.type if isinstance(cause, ApplicationError) else CONFLICT
            raise ApplicationError(str(cause or exc), type=kind or CONFLICT) from exc

    @workflow.query(name=STATE_QUERY)
    def state(self) -> RunState:
        return self.state

    @workflow.update(name=DECIDE_UPDATE)
    async def decide_approval(self, decision: Decision) -> str:
        return await self._decide(decision)

    @decide_approval.validator
    def _validate_decision(self, decision: Decision) -> None:
        refusal = self._decision_refusal(decision.approval_id)
        if refusal:
            raise ValueError(refusal)

    def _decision_refusal(self, approval_id: str) -> str | None:
        if approval_id not in self.state.pending_approvals:
            return f"approval {approval_id!r} is not pending in this run"
        if approval_id in self._inbox.after_decision:
            return f"approval {approval_id!r} is already decided"
        return None

    @workflow.signal(name=DECISION_SIGNAL)
    async def approval_decision(self, decision: Decision) -> None:
        try:
            await self._decide(await self._signalled_by(decision, DECISION_SIGNAL))
        except ApplicationError as exc:
            workflow.logger.warning("approval decision refused: %s", exc)

    async def _decide(self, decision: Decision) -> str:
        refusal = self._decision_refusal(decision.approval_id)
        if refusal:
            raise ApplicationError(refusal, type=CONFLICT)
        pending = self.state.pending_approvals[decision.approval_id]
        async with self._status.carrying():
            try:
                out = await self._handler_activity(
                    WriteActivities.decide_approval,
                    RecordDecisionInput(
                        decision=decision,
                        snapshot=self.state.snapshot,
                        write_policy=self.request.write_policy,
                        run_status=self._status.once_decided(decision.approval_id),
                        request_key=_update_key(),
                    ),
                    f"record {decision.decision}",
                    tool=pending.tool_name,
                )
            except ApplicationError as exc:
                if self._routes.queue(pending.tool_name) is None:
                    raise
                # On a tool worker that failed, the decision may have been
                # recorded all the same: follow the store, and answer with
                # this request's record, never with another's.
                if not workflow.patched(DECISION_BY_REQUEST_PATCH):
                    return await self._decided_as_it_stands(decision, pending, exc)
                if final(exc.__cause__):  # the activity's own refusal: its answer
                    raise
                out = await self._writes.request_decision(
                    pending,
                    RecordDecisionInput(
                        decision=decision,
                        run_status=self._status.once_decided(decision.approval_id),
                        request_key=_update_key(),
                    ),
                )
                if out.approval_status == ApprovalStatus.PENDING:
                    raise
                if out.conflict:
                    raise ApplicationError(
                        f"approval {decision.approval_id!r} is {out.conflict} ({exc})",
                        type=CONFLICT,
                    ) from exc
            self._status.told(out.run_status)
        if out.edits:
            self._inbox.edits[out.approval_id] = out.edits
        # The database's answer stands, whichever decision won; a decision it
        # refused while the approval stays pending (wrong digest, late edits)
        # changes nothing here either.
        write = self.state.pending_approvals.get(out.approval_id)
        if write is not None:
            self._writes.follow(write, out, answered=True)
        elif not self._inbox.new_rules:
            self._inbox.after_decision.setdefault(out.approval_id, out.status)
        if out.conflict:
            raise ApplicationError(out.conflict, type=CONFLICT)
        return out.approval_status

    async def _decided_as_it_stands(
        self, decision: Decision, pending: PendingWrite, failed: ApplicationError
    ) -> str:
        """The fallback of runs that took it before DECISION_BY_REQUEST_PATCH:
        the approval's status alone, taken as the caller's when it is what
        they asked for."""
        now = await self._writes.check_approval(pending)
        if now == decision.decision:
            return now
        if now == ApprovalStatus.PENDING:
            raise failed
        raise ApplicationError(
            f"approval {decision.approval_id!r} is {now} ({failed})", type=CONFLICT
        ) from failed

    @workflow.update(name=EXTEND_UPDATE)
    async def extend_approval(self, request: ExtendInput) -> ExtendOutput:
        """Push an approval's deadline back; the expiry timer follows."""
        keyed = request.model_copy(update={"request_key": _update_key()})
        extended = await self._handler_activity(
            WriteActivities.extend_approval, keyed, f"extend approval by {request.seconds}s"
        )
        write = self.state.pending_approvals.get(request.approval_id)
        if write is not None:
            write.approval_deadline = extended.expires_at
            self._inbox.refreshes += 1  # wake the wait so it re-arms its timer
        return extended

    @extend_approval.validator
    def _validate_extension(self, request: ExtendInput) -> None:
        refusal = self._decision_refusal(request.approval_id)
        if refusal:
            raise ValueError(refusal)

    @workflow.update(name=RECONCILE_UPDATE)
    async def reconcile_action(self, request: ReconcileInput) -> str:
        return await self._reconcile(request)

    @reconcile_action.validator
    def _validate_reconcile(self, request: ReconcileInput) -> None:
        refusal = self._reconcile_refusal(request.action_id)
        if refusal:
            raise refusal

    def _reconcile_refusal(self, action_id: str) -> ApplicationError | None:
        settled = action_id in self._inbox.after_reconcile and self._inbox.new_rules
        if action_id not in self.state.unknown_actions or settled:
            return ApplicationError(
                f"action {action_id!r} is not awaiting reconciliation in this run",
                type=NOT_TRACKED,
            )
        return None

    @workflow.signal(name=RECONCILE_SIGNAL)
    async def reconcile_action_signal(self, request: ReconcileInput) -> None:
        try:
            await self._reconcile(await self._signalled_by(request, RECONCILE_SIGNAL))
        except ApplicationError as exc:
            workflow.logger.warning("reconciliation refused: %s", exc)

    async def _reconcile(self, request: ReconcileInput) -> str:
        refusal = self._reconcile_refusal(request.action_id)
        if refusal:
            raise refusal
        tool = self.state.unknown_actions[request.action_id].tool_name
        try:
            out = await self._handler_activity(
                WriteActivities.reconcile_action, request, f"reconcile as {request.outcome}", tool
            )
        except ApplicationError:
            if self._routes.queue(tool) is not None:
                # A tool worker that failed may have reconciled it all the
                # same: follow the store, and answer with this request's
                # record, never with another's.
                if not workflow.patched(RECONCILE_BY_REQUEST_PATCH):
                    now = await self._writes.check_reconciled(request.action_id)
                    if now == request.outcome:  # the old rule: what was asked stands
                        return now
                    raise
                seen = await self._writes.reconciled_by_request(request)
                if seen.conflict is None:
                    return seen.status
            raise
        if out.status in SETTLED:
            self._inbox.after_reconcile.setdefault(out.action_id, out.status)
        if out.retry_at is not None:
            raise ApplicationError(
                out.conflict, out.retry_at.isoformat(), type=ATTEMPT_MAY_BE_RUNNING
            )
        if out.conflict:
            raise ApplicationError(out.conflict, type=CONFLICT)
        return out.status

    async def _signalled_by(self, message, signal_name: str):  # type: ignore[no-untyped-def]
        """Whoever sent a raw signal is its Temporal identity, found in the
        history by this very signal's payload (its request id makes it one of
        a kind), never the name written in its body. When the history cannot
        say whose it was, it is recorded as ``temporal:unknown``."""
        identity = await self._handler_activity(
            WriteActivities.signal_sender,
            SignalSender(
                workflow_id=workflow.info().workflow_id,
                signal_name=signal_name,
                payload=message.model_dump(mode="json", exclude_unset=True),
            ),
            "who sent this signal",
        )
        who = f"temporal:{identity or 'unknown'}"
        return message.model_copy(update={"decided_by": who[:255]})

    @workflow.signal(name=REFRESH_SIGNAL)
    def refresh(self) -> None:
        """The sweep changed something in the store: re-read what we wait on."""
        self._inbox.refreshes += 1


def _failure_of(exc: BaseException) -> dict[str, str]:
    """What the store records of why a run failed: the innermost application
    error's type and message, or what kind of timeout it was."""
    where = f"{exc.activity_type}: " if isinstance(exc, ActivityError) else ""
    cause: BaseException | None = exc
    while isinstance(cause, ActivityError) and cause.cause is not None:
        cause = cause.cause
    if isinstance(cause, ApplicationError):
        code = cause.type or "ApplicationError"
    elif isinstance(cause, TemporalTimeout):
        code = f"timeout_{cause.type.name.lower()}" if cause.type else "timeout"
    else:
        code = type(cause).__name__
    return {"code": code[:64], "message": f"{where}{cause}"[:1000]}


def _run_ended(call: ToolCall) -> ToolOutcome:
    return ToolOutcome(
        call_id=call.id,
        tool_name=call.name,
        status="error",
        content={"error_code": "run_ended", "message": "the run is ending"},
    )


def _since_last_turn(transcript: list[ChatMessage], seat: str) -> list[ChatMessage]:
    for index in range(len(transcript) - 1, -1, -1):
        if transcript[index].name == seat:
            return transcript[index + 1 :]
    return list(transcript)


def _update_key() -> str | None:
    """The request the update being handled is an attempt of (None outside
    one): what an operator's change is recorded under, so its local
    activity, retried after a first attempt that committed, does not apply
    it twice, nor does another attempt of the same request (an update id
    "<request>/<attempt>", names.KEYED_ATTEMPT). Any other id (the SDK's
    own, every update before it) is its own request."""
    info = workflow.current_update_info()
    if info is None:
        return None
    attempt = KEYED_ATTEMPT.fullmatch(info.id)
    return attempt.group(1) if attempt is not None else info.id
