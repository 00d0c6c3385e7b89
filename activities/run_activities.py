"""Activities of a run that have no external side effects: retrying them is safe."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from pydantic import ValidationError
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.bounded import bounded_result, bounded_text
from activities.errors import typed_store_errors
from activities.kept_snapshots import KeptSnapshots, kept_form, snapshot_digest
from roundtable.agents import UnknownModelError, resolve_model
from roundtable.agents.base import ModelAdapter
from roundtable.agents.prompts import manager_messages, round_prompt, seat_system_prompt
from roundtable.agents.tool_calls import sanitize_tool_calls
from roundtable.models import (
    CapabilitySnapshot,
    ChatMessage,
    EnsureRunInput,
    EnsureRunOutput,
    ReadToolInput,
    RunStatusInput,
    RunStatusOutput,
    TakeTurnInput,
    TakeTurnOutput,
    ToolOutcome,
    ToolSpec,
    TurnRequest,
    TurnResponse,
)
from roundtable.names import INVALID_INPUT
from roundtable.permissions import (
    Authority,
    ModelNotAllowedError,
    PolicyNotAllowedError,
    TenantNotAllowedError,
    check_tenant,
)
from roundtable.security import redact_text
from roundtable.store import Store
from roundtable.telemetry.metrics import Metrics
from roundtable.telemetry.tracing import tool_span
from roundtable.tools.registry import (
    ToolArgumentsError,
    ToolContext,
    ToolDefinition,
    ToolRegistry,
    snapshot_of,
)
from roundtable.webhooks import receiver_label

log = logging.getLogger("roundtable.activities")

# A read tool failed; Temporal retries the read (its own error is redacted).
TOOL_READ_FAILED = "ToolReadFailed"


class RunActivities:
    def __init__(
        self,
        store: Store,
        registry: ToolRegistry,
        webhook_urls: list[str] | None = None,
        expiring_lead_seconds: int = 300,
        *,
        authority: Authority,
        metrics: Metrics | None = None,
        catalog: bool = False,
    ) -> None:
        self.store = store
        self.registry = registry
        # A workflows worker (no tools of its own): runs take their tools from
        # the catalog tool workers publish, and route their calls to them.
        self.catalog = catalog
        self.authority = authority
        self.metrics = metrics or Metrics()
        self.webhook_urls = list(webhook_urls or [])
        self.expiring_lead_seconds = expiring_lead_seconds
        self.snapshots = KeptSnapshots(store)

    @activity.defn(name="ensure_run")
    @typed_store_errors
    async def ensure_run(self, inp: EnsureRunInput) -> EnsureRunOutput:
        """Create the run's rows (once) and pin its capability snapshot."""
        require_own_run(inp.run_id)
        specs = {name: tool.spec() for name, tool in self.registry.tools.items()}
        routes: dict[str, str] = {}
        if self.catalog:
            for name, (spec, queue) in (await self.store.published_tools()).items():
                if name in specs:
                    continue
                if queue == activity.info().task_queue:  # nobody here serves tools
                    log.warning("tool %s is published on the workflows queue: ignored", name)
                    continue
                try:
                    specs[name], routes[name] = ToolSpec.model_validate(spec), queue
                except ValidationError as exc:  # a newer worker's, say: one tool lost, not all
                    log.warning("tool %s is published in a form not understood: %s", name, exc)
        try:
            snapshot = snapshot_of(specs, inp.seats, inp.tools, inp.seat_tools)
        except ValueError as exc:
            raise ApplicationError(str(exc), type=INVALID_INPUT, non_retryable=True) from exc
        run = await self.store.ensure_run(
            run_id=inp.run_id, user_id=inp.user_id, task_text=inp.task_text
        )
        self._check_granted(run, inp)
        if inp.keep_snapshot:
            digest, body = kept_form(snapshot)
        else:
            digest, body = snapshot_digest(snapshot), None
        status = await self.store.pin_snapshot(run["id"], digest, status=inp.open_as, body=body)
        if body is not None:
            self.snapshots.remember(digest, snapshot, len(body))
        return EnsureRunOutput(
            run_id=run["id"],
            session_id=run["session_id"],
            snapshot=snapshot,
            # Labels, not URLs: a receiver's URL may carry its own secret.
            webhook_urls=[receiver_label(url) for url in self.webhook_urls],
            expiring_lead_seconds=self.expiring_lead_seconds,
            tool_queues={t.name: routes[t.name] for t in snapshot.tools if t.name in routes},
            run_status=status if inp.open_as is not None else None,
            snapshot_digest=digest if inp.keep_snapshot else None,
        )

    def _check_granted(self, run: dict, inp: EnsureRunInput) -> None:
        """The worker's own check of what the server allows, so a run started
        straight through Temporal gets no more than the service ceiling."""
        try:
            if inp.write_policy is not None:
                granted = self.authority.granted_policy(
                    run, inp.write_policy, inp.request_fingerprint
                )
                if granted != inp.write_policy:
                    raise PolicyNotAllowedError(
                        f"write_policy {inp.write_policy!r} was not granted to this run "
                        f"(at most {granted!r} without the API or CLI)"
                    )
            self.authority.check_models(inp.models)
        except (PolicyNotAllowedError, ModelNotAllowedError) as exc:
            raise ApplicationError(str(exc), type=exc.code, non_retryable=True) from exc

    async def _tools(self, inp: TakeTurnInput) -> list[ToolSpec]:
        """The seat's tools: carried by the turn, or named by digest."""
        if inp.tools_of is None:
            return inp.tools
        return (await self.snapshots.get(inp.tools_of)).tools_for(inp.seat)

    @activity.defn(name="take_turn")
    async def take_turn(self, inp: TakeTurnInput) -> TakeTurnOutput:
        """One model call, kept: the turn's first answer is its only answer.
        A turn taken again (a retry whose result was lost, a reset that
        dropped its completion) gets the kept response, not a new one whose
        tool calls, named afresh by the model, would be new writes."""
        require_own_run(inp.run_id)
        try:
            adapter = resolve_model(inp.model)
        except UnknownModelError as exc:
            raise ApplicationError(str(exc), type=INVALID_INPUT, non_retryable=True) from exc
        if inp.role == "manager":
            messages = manager_messages(inp.task_text, inp.others)
            new_messages: list[ChatMessage] = []
        else:
            history = inp.thread or [seat_system_prompt(inp.seat, inp.task_text, inp.role_prompt)]
            prompt = round_prompt(inp.round, inp.others)
            messages = [*history, prompt]
            new_messages = ([] if inp.thread else history) + [prompt]
        turn = {
            "run_id": inp.run_id,
            "role": inp.role,
            "seat": inp.seat,
            "round_number": inp.round,
            "chain": inp.chain,
        }
        kept = await self.store.kept_turn(**turn) if _may_have_been_taken(inp) else None
        if kept is None:
            asked = await self._ask(adapter, inp, messages)
            kept, ours = await self.store.keep_turn(**turn, response=asked.model_dump(mode="json"))
            if ours and asked.usage is not None:  # tokens spent on the answer kept
                self.metrics.model_tokens(
                    inp.model or "default", asked.usage.prompt_tokens, asked.usage.completion_tokens
                )
        response = TurnResponse.model_validate(kept)
        if response.usage is not None:
            # The kept answer's usage, once per turn (the log finds its event):
            # whichever attempt asked, the log's usage is the workflow's.
            await self.store.record_turn(
                inp.run_id,
                seat=inp.seat,
                round_number=inp.round,
                model=inp.model,
                prompt_tokens=response.usage.prompt_tokens,
                completion_tokens=response.usage.completion_tokens,
                role=inp.role,
                chain=inp.chain,
            )
        reply = ChatMessage(
            role="assistant", name=inp.seat, content=response.text, tool_calls=response.tool_calls
        )
        return TakeTurnOutput(response=response, new_messages=[*new_messages, reply])

    async def _ask(
        self, adapter: ModelAdapter, inp: TakeTurnInput, messages: list[ChatMessage]
    ) -> TurnResponse:
        """The model's answer, its text bounded."""
        response = await adapter.respond(
            TurnRequest(
                run_id=inp.run_id,
                seat=inp.seat,
                round=inp.round,
                role=inp.role,
                model=inp.model,
                messages=messages,
                tools=await self._tools(inp),
                script=inp.script,
                reasoning_effort=inp.reasoning_effort,
            )
        )
        response = response.model_copy(
            update={
                "text": await bounded_text(
                    self.store,
                    run_id=inp.run_id,
                    seat=inp.seat,
                    call_id=f"turn:{inp.role}:r{inp.round}",
                    text=response.text,
                ),
                "tool_calls": sanitize_tool_calls(response.tool_calls),
            }
        )
        return response

    @activity.defn(name="run_read_tool")
    async def run_read_tool(self, inp: ReadToolInput) -> ToolOutcome:
        """A read tool call. Bad arguments are the seat's mistake, told back to it."""
        require_own_run(inp.run_id)
        tool = self.registry.get(inp.call.name)
        if tool is None or tool.side_effect != "read":
            return _error(
                inp.call.id,
                inp.call.name,
                "tool_unavailable",
                f"{inp.call.name} is not a read tool on this worker",
            )
        try:
            parsed = tool.parse(inp.call.arguments)
        except ToolArgumentsError as exc:
            return _error(inp.call.id, inp.call.name, "invalid_arguments", str(exc))
        # A tenant-limited run reads only its own tenants' data, as it writes.
        tenants = (await self.store.get_run(inp.run_id))["tenants"]
        if tenants is not None:
            tenant = tool.normalize(inp.call.arguments).get(tool.tenant_field or "")
            try:
                check_tenant(tenants, tenant if tool.tenant_field else None, f"run {inp.run_id}")
            except TenantNotAllowedError as exc:
                return _error(inp.call.id, inp.call.name, exc.code, str(exc))
        if not tool.retry_safe and (activity.info().attempt > 1 or inp.prior_attempt):
            return _error(
                inp.call.id,
                inp.call.name,
                "not_retried",
                f"{inp.call.name} may already have run and is not run twice: its server's "
                "read-only hint is not trusted",
            )
        began = time.monotonic()
        try:
            with tool_span(tool.name, run_id=inp.run_id):
                result = await tool.handler(parsed, ToolContext(run_id=inp.run_id, seat=inp.seat))
        except Exception as exc:
            self.metrics.tool_call(tool.name, "failed", time.monotonic() - began)
            # A tool's error may quote its arguments: what is kept (the run's
            # record, the worker's log, a trace) is redacted of them.
            said = redact_text(str(exc), inp.call.arguments, tool.safe_argument_fields)
            message = said or type(exc).__name__
            if tool.retry_safe:  # Temporal retries it, with the cause's words redacted
                raise ApplicationError(
                    f"{tool.name} failed ({type(exc).__name__}): {message}", type=TOOL_READ_FAILED
                ) from None
            return _error(inp.call.id, inp.call.name, "tool_error", message)
        self.metrics.tool_call(tool.name, "succeeded", time.monotonic() - began)
        return ToolOutcome(
            call_id=inp.call.id,
            tool_name=tool.name,
            status="succeeded",
            content=await bounded_result(
                self.store,
                run_id=inp.run_id,
                seat=inp.seat,
                call_id=inp.call.id,
                content=json.loads(json.dumps(result, default=str)),
            ),
        )

    @activity.defn(name="set_run_status")
    @typed_store_errors
    async def set_run_status(self, inp: RunStatusInput) -> RunStatusOutput:
        require_own_run(inp.run_id)
        run = await self.store.set_run_status(inp.run_id, inp.status, inp.failure)
        return RunStatusOutput(run_id=run["id"], status=run["status"])


# What of a tool's spec decides how its writes are gated and leased.
_GATING_FACTS = ("side_effect", "risk_level", "target_key_fields", "target_key_namespace")


def pinned_snapshot(
    run: dict[str, Any], snapshot: CapabilitySnapshot, tool: ToolDefinition | None = None
) -> None:
    """The workflow's snapshot is the one the worker pinned the run to: a
    workflow started straight through Temporal with a made-up state (other
    risk levels, other key fields) is refused before its write is recorded.
    A run from before pinning has no digest: its tool must then be as this
    worker knows it."""
    if run.get("snapshot_digest") is None and tool is not None:
        claimed = snapshot.tool(tool.name)
        known = tool.spec()
        if claimed is not None and all(
            getattr(claimed, f) == getattr(known, f) for f in _GATING_FACTS
        ):
            return
    if run.get("snapshot_digest") != snapshot_digest(snapshot):
        raise ApplicationError(
            f"run {run['id']!r} was not pinned to this capability snapshot",
            type="snapshot_not_pinned",
            non_retryable=True,
        )


def _may_have_been_taken(inp: TakeTurnInput) -> bool:
    """Whether this turn may have an answer kept already, so that it is read
    before the model is asked: a retry (its first attempt may have kept one
    and lost its result), or an execution other than its chain's first (a
    reset's, whose dropped tail may hold the turn; a continue-as-new's). A
    first attempt in the chain's first execution is normally this turn's
    first ask: the workflow schedules each turn once, and another chain keeps
    its turns under other ids (an operator's activity reset puts the attempt
    back to 1, and the turn is asked again). Only a saving, never what makes
    the first answer the only one: keeping the answer refuses a second and
    returns the first (Turns.keep), so a turn wrongly judged new costs one
    model call, not a write. Runs from before chains (no ``chain``) are
    always read."""
    if inp.chain is None:
        return True
    info = activity.info()
    return info.attempt > 1 or info.workflow_run_id != inp.chain


def require_own_run(run_id: str) -> None:
    """A run's rows are the business of its own workflow (whose id is the
    run id) only: another workflow naming it, say one started straight
    through Temporal to borrow an operator run's grant, is refused."""
    workflow_id = activity.info().workflow_id
    if workflow_id != run_id:
        raise ApplicationError(
            f"workflow {workflow_id!r} is not run {run_id!r}'s own",
            type="not_this_runs_workflow",
            non_retryable=True,
        )


def _error(call_id: str, tool_name: str, code: str, message: str) -> ToolOutcome:
    return ToolOutcome(
        call_id=call_id,
        tool_name=tool_name,
        status="error",
        content={"error_code": code, "message": message},
    )
