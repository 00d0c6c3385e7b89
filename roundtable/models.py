"""Pydantic models crossing the workflow boundary (inputs, outputs, messages).

Everything here is plain data: the workflow sandbox imports it, activities and
clients build it, the pydantic data converter carries it through Temporal.
(Over 400 lines on purpose: this is the payload contract of running
workflows, which replay depends on; one module keeps every change to it in
one reviewable place.)
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

from roundtable.states import ActionStatus, ApprovalStatus, ClaimOutcome, WriteEnd

RiskLevel = Literal["R0", "R1", "R2", "R3"]
SideEffect = Literal["read", "write"]
RunMode = Literal["structured", "parallel"]
_POLICY = re.compile(r"^(confirm_all_writes|deny_writes|auto_approve_up_to:R[0-3])$")
_SEAT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


def omitted_while_none(data: Any, *names: str) -> Any:
    """``data`` (a model's serialized fields) without these fields while they
    are None. For fields added to what workers hand one another: during a
    rolling deploy a worker still on the release before reads what this one
    wrote, and its models forbid fields they do not know, so a new field that
    says nothing must not be sent at all (an old run's activity, say, run by a
    new worker). Called from the model's own wrap serializer."""
    if isinstance(data, dict):
        for name in names:
            if name in data and data[name] is None:
                del data[name]
    return data


# ----------------------------------------------------------------- scripted model


# Bounds on what a request may carry. Everything a run is asked for travels in
# its workflow's history (and the script in every turn's input): Temporal
# refuses payloads over 2 MiB and histories over 50 MB, and a workflow that
# hits either is wedged, so the door refuses more than these.
MAX_SEATS = 12
MAX_TOOLS = 64
MAX_NAME_CHARS = 128
MAX_TEXT_CHARS = 20_000
MAX_ROLE_CHARS = 4_000
MAX_SCRIPT_TURNS = 1_000
MAX_SCRIPT_BYTES = 128 * 1024
MAX_CALLS_PER_TURN = 16

Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]


class ScriptedToolCall(Model):
    name: Name
    args: dict[str, Any] = Field(default_factory=dict)
    id: str | None = Field(default=None, max_length=MAX_NAME_CHARS)


class ScriptedTurn(Model):
    seat: Name
    round: int = Field(ge=1, le=1_000)
    text: str = Field(default="", max_length=MAX_TEXT_CHARS)
    tool_calls: list[ScriptedToolCall] = Field(default_factory=list, max_length=MAX_CALLS_PER_TURN)


class ScriptDocument(Model):
    """``{"turns": [{"seat", "round", "text", "tool_calls": [{"name", "args"}]}], "final"}``"""

    turns: list[ScriptedTurn] = Field(default_factory=list, max_length=MAX_SCRIPT_TURNS)
    final: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)

    @model_validator(mode="after")
    def _one_entry_per_seat_and_round(self) -> ScriptDocument:
        seen: set[tuple[str, int]] = set()
        for turn in self.turns:
            if (turn.seat, turn.round) in seen:
                raise ValueError(f"two script entries for {turn.seat} in round {turn.round}")
            seen.add((turn.seat, turn.round))
        size = len(self.model_dump_json().encode())
        if size > MAX_SCRIPT_BYTES:
            raise ValueError(f"the script is {size} bytes; at most {MAX_SCRIPT_BYTES}")
        return self


# ----------------------------------------------------------------- run input


_LATER_KNOBS = ("tool_worker_wait_seconds",)


class RunInput(Model):
    """What a caller asks for. Validated at the door, so a run never starts
    with input it cannot finish."""

    task_text: str = Field(min_length=1, max_length=MAX_TEXT_CHARS)
    seats: list[str] = Field(
        default_factory=lambda: ["seat-1", "seat-2"], min_length=1, max_length=MAX_SEATS
    )
    manager: str | None = "manager"
    max_rounds: int = Field(default=1, ge=1, le=50)
    mode: RunMode = "structured"
    write_policy: str = "confirm_all_writes"
    model: Name = "scripted"
    script: ScriptDocument | None = None
    approval_timeout_seconds: int = Field(default=3600, ge=1, le=30 * 24 * 3600)
    user_id: str = Field(default="local-user", min_length=1, max_length=255)
    tools: list[Name] | None = Field(default=None, max_length=MAX_TOOLS)
    # Per seat (and the manager): which model, which role, which tools.
    seat_models: dict[str, Name] = Field(default_factory=dict, max_length=MAX_SEATS + 1)
    seat_roles: dict[str, Annotated[str, Field(max_length=MAX_ROLE_CHARS)]] = Field(
        default_factory=dict, max_length=MAX_SEATS + 1
    )
    seat_tools: dict[str, Annotated[list[Name], Field(max_length=MAX_TOOLS)]] = Field(
        default_factory=dict, max_length=MAX_SEATS + 1
    )
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    run_id: str | None = Field(default=None, min_length=1, max_length=64)
    # Execution knobs; defaults suit production, tests shorten them.
    lease_seconds: int = Field(default=30, ge=2, le=3600)
    heartbeat_timeout_seconds: int = Field(default=20, ge=1, le=3600)
    # How long a tool call waits for a tool worker to take it before the run
    # says none serves the tool (worker roles); None: 60 s.
    tool_worker_wait_seconds: int | None = Field(default=None, ge=1, le=3600)

    def models(self) -> set[str]:
        """Every model this run would call."""
        return {self.model, *self.seat_models.values()}

    def fingerprint(self) -> str:
        """What this request asks for, whatever its run id: the grant the API
        recorded holds only for the request it checked."""
        # Knobs added later count only when set: the fingerprint of a request
        # made before them (a run in flight, its grant recorded) stays the same.
        unset = {k for k in _LATER_KNOBS if getattr(self, k) is None}
        body = json.dumps(self.model_dump(mode="json", exclude={"run_id", *unset}), sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()

    @field_validator("seats")
    @classmethod
    def _valid_seats(cls, seats: list[str]) -> list[str]:
        for seat in seats:
            if not _SEAT_ID.match(seat):
                raise ValueError(f"seat id {seat!r} must be 1-64 letters, digits, '-', '_' or '.'")
        if len(set(seats)) != len(seats):
            raise ValueError("seat ids must be unique")
        return seats

    @field_validator("write_policy")
    @classmethod
    def _valid_policy(cls, policy: str) -> str:
        if not _POLICY.match(policy):
            raise ValueError(
                "write_policy must be confirm_all_writes, deny_writes or auto_approve_up_to:R0..R3"
            )
        return policy

    @field_validator("manager")
    @classmethod
    def _valid_manager(cls, manager: str | None) -> str | None:
        if manager is not None and not _SEAT_ID.match(manager):
            raise ValueError("the manager's id must be 1-64 letters, digits, '-', '_' or '.'")
        return manager

    @model_validator(mode="after")
    def _consistent(self) -> RunInput:
        if self.manager is not None and self.manager in self.seats:
            raise ValueError("the manager cannot also be a seat")
        known = {*self.seats, *([self.manager] if self.manager else [])}
        for name, mapping in (
            ("seat_models", self.seat_models),
            ("seat_roles", self.seat_roles),
            ("seat_tools", self.seat_tools),
        ):
            strangers = sorted(set(mapping) - known)
            if strangers:
                raise ValueError(f"{name} names unknown seats: {', '.join(strangers)}")
        models = {self.model, *self.seat_models.values()}
        if "scripted" in models and self.script is None:
            self.script = ScriptDocument()
        if self.heartbeat_timeout_seconds >= self.lease_seconds:
            raise ValueError("heartbeat_timeout_seconds must be shorter than lease_seconds")
        return self


# ----------------------------------------------------------------- tools and agents


class ToolSpec(Model):
    """A tool as the run's capability snapshot records it (no code, just facts)."""

    # Frozen, as the snapshot that holds it: runs share one copy of a snapshot
    # (roundtable/shared_snapshots.py).
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str
    side_effect: SideEffect
    risk_level: RiskLevel
    target_key_fields: list[str] = Field(default_factory=list)
    target_key_namespace: str | None = None
    safe_argument_fields: list[str] = Field(default_factory=list)
    parameters: dict[str, Any] = Field(default_factory=dict)


class SeatGrant(Model):
    model_config = ConfigDict(extra="forbid", frozen=True)

    agent_id: str
    # A tuple, as the snapshot's own fields: runs share it, and reads are
    # routed by it alone (roundtable/shared_snapshots.py).
    tools: tuple[str, ...]


class CapabilitySnapshot(Model):
    # Frozen, its sequences tuples: a worker's runs share one copy of each
    # (shared_snapshots.py). The JSON is the same arrays as before.
    model_config = ConfigDict(extra="forbid", frozen=True)

    tools: tuple[ToolSpec, ...]
    agents: tuple[SeatGrant, ...]

    def tool(self, name: str) -> ToolSpec | None:
        return next((t for t in self.tools if t.name == name), None)

    def granted(self, agent_id: str, tool_name: str) -> bool:
        return any(a.agent_id == agent_id and tool_name in a.tools for a in self.agents)

    def tools_for(self, agent_id: str) -> list[ToolSpec]:
        names = next((a.tools for a in self.agents if a.agent_id == agent_id), [])
        return [t for t in self.tools if t.name in names]


class ToolCall(Model):
    id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    # Set when the model's call could not be read (e.g. arguments that are not
    # a JSON object): the seat is told, nothing runs.
    malformed: str | None = None


class ChatMessage(Model):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    name: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_call_id: str | None = None


class TokenUsage(Model):
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def plus(self, other: TokenUsage | None) -> TokenUsage:
        if other is None:
            return self
        return TokenUsage(
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            completion_tokens=self.completion_tokens + other.completion_tokens,
        )


class TurnRequest(Model):
    run_id: str
    seat: str
    round: int
    role: Literal["seat", "manager"]
    model: str
    reasoning_effort: str | None = None
    messages: list[ChatMessage]
    tools: list[ToolSpec] = Field(default_factory=list)
    script: ScriptDocument | None = None


class TurnResponse(Model):
    text: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    usage: TokenUsage | None = None


# ----------------------------------------------------------------- activities I/O


class EnsureRunInput(Model):
    run_id: str
    user_id: str
    task_text: str
    seats: list[str]
    tools: list[str] | None = None
    seat_tools: dict[str, list[str]] = Field(default_factory=dict)
    # Checked against what the server granted the run (roundtable/permissions.py).
    write_policy: str | None = None
    models: list[str] = Field(default_factory=list)
    request_fingerprint: str | None = None
    # Runs started under rules-as-of-2026-12 open as "running" in the same
    # transaction that pins their snapshot, instead of a status write of its
    # own after (None: older runs, which publish it themselves).
    open_as: str | None = None
    # Keep the snapshot's body in the store under its digest (rules-as-of-
    # 2026-12): the run's seat turns then name the digest instead of
    # carrying their tool specs (TakeTurnInput.tools_of).
    keep_snapshot: bool | None = None

    @model_serializer(mode="wrap")
    def _rollout(self, handler: Any) -> Any:
        return omitted_while_none(handler(self), "open_as", "keep_snapshot")


class EnsureRunOutput(Model):
    run_id: str
    session_id: str
    snapshot: CapabilitySnapshot
    # Worker configuration the run follows: where to send webhooks, and how
    # long before an approval's deadline to warn that it is expiring.
    webhook_urls: list[str] = Field(default_factory=list)
    expiring_lead_seconds: int = 300
    # Tools served by tool workers elsewhere (worker roles): the task queue
    # each one's calls go to. A tool not named here runs where the run does.
    tool_queues: dict[str, str] = Field(default_factory=dict)
    # The run's status in the store as the opening left it (with ``open_as``).
    run_status: str | None = None
    # The digest the snapshot's body is kept under (with ``keep_snapshot``).
    snapshot_digest: str | None = None

    @model_serializer(mode="wrap")
    def _rollout(self, handler: Any) -> Any:
        return omitted_while_none(handler(self), "run_status", "snapshot_digest")


class WebhookEvent(Model):
    event_id: str  # stable across retries: receivers de-duplicate on it
    event_type: str
    run_id: str
    occurred_at: datetime
    data: dict[str, Any] = Field(default_factory=dict)


class WebhookDelivery(Model):
    event: WebhookEvent
    url: str


class TakeTurnInput(Model):
    run_id: str
    seat: str
    round: int
    role: Literal["seat", "manager"]
    model: str
    task_text: str
    role_prompt: str | None = None
    reasoning_effort: str | None = None
    thread: list[ChatMessage] = Field(default_factory=list)
    others: list[ChatMessage] = Field(default_factory=list)
    tools: list[ToolSpec] = Field(default_factory=list)
    # Instead of ``tools``: the seat's tools are those the snapshot kept under
    # this digest grants it (read once per worker, not carried each turn).
    tools_of: str | None = None
    script: ScriptDocument | None = None
    # The run's first execution: turns are kept per chain of executions
    # (activities/run_activities.py take_turn), so a reset or continue-as-new
    # meets its kept answers and a new start under the same run id does not.
    chain: str | None = None

    @model_serializer(mode="wrap")
    def _rollout(self, handler: Any) -> Any:
        return omitted_while_none(handler(self), "tools_of", "chain")


class TakeTurnOutput(Model):
    response: TurnResponse
    new_messages: list[ChatMessage]


class ReadToolInput(Model):
    run_id: str
    seat: str
    call: ToolCall
    # Read by nothing: the read runs the worker's own tool and the workflow
    # checked the grant. Runs send an empty one (it was the whole snapshot,
    # in every read's history event); the field stays, required, while
    # workers of the release before, whose model requires it, may read this.
    snapshot: CapabilitySnapshot = Field(
        default_factory=lambda: CapabilitySnapshot(tools=[], agents=[])
    )
    # An earlier attempt of this call may have run (on a tool worker that
    # failed): a read that may not run twice is not run again.
    prior_attempt: bool = False


class ToolOutcome(Model):
    """What a seat is told about one of its tool calls."""

    call_id: str
    tool_name: str
    status: str
    content: dict[str, Any] = Field(default_factory=dict)


class InterceptInput(Model):
    run_id: str
    session_id: str
    seat: str
    round: int
    call: ToolCall
    snapshot: CapabilitySnapshot
    write_policy: str
    approval_deadline: datetime
    # Checked against the run row: the grant and the snapshot the worker
    # recorded hold only for this very request and snapshot.
    request_fingerprint: str | None = None
    # What the run shows while this write waits for approval, set in the
    # transaction that opens the approval (workflows/status.py); None: the
    # workflow publishes it.
    run_status_while_waiting: str | None = None


class PendingWrite(Model):
    """A write the workflow is steering to its end."""

    action_id: str
    call_id: str
    seat: str
    tool_name: str
    status: ActionStatus | Literal["refused"]
    approval_id: str | None = None
    approval_deadline: datetime | None = None
    rejection: ToolOutcome | None = None  # set when intercept refused the call
    # An action met again (after a reset, retry or continue-as-new) that had
    # already come to an end: its stored result.
    result: dict[str, Any] | None = None
    # The run's status as the intercept's transaction left it, when it opened
    # the approval carrying InterceptInput.run_status_while_waiting.
    run_status: str | None = None


class ExecuteWriteInput(Model):
    action_id: str
    seat: str
    lease_seconds: int
    heartbeat_interval_seconds: float


class ExecuteWriteOutput(Model):
    claim: ClaimOutcome | WriteEnd
    status: ActionStatus
    result: dict[str, Any] | None = None


class Attestation(Model):
    """The server's word (an HMAC under a key derived from the action secret,
    which Temporal never sees) that whoever sent a decision or reconciliation
    was authenticated by the API or CLI in this role, for these tenants, at
    this time, for exactly this message (roundtable/permissions.py)."""

    role: str = Field(max_length=16)
    tenants: list[str] | None = Field(default=None, max_length=1000)
    at: datetime
    mac: str = Field(max_length=128)


def canonical_digest(value: Any) -> str | None:
    """A stable digest of a JSON value (None stays None)."""
    if value is None:
        return None
    body = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(body.encode()).hexdigest()


class Decision(Model):
    approval_id: str
    decision: Literal["approved", "rejected"]
    # Names this message: a raw signal's sender is found in the history by it.
    request_id: str | None = Field(default=None, max_length=64)
    decided_by: str = Field(min_length=1, max_length=255)
    reason: str | None = Field(default=None, max_length=2000)
    arguments_digest: str | None = Field(default=None, max_length=80)
    # Approve with edits: the corrected full arguments (approvals only).
    arguments: dict[str, Any] | None = None
    # Who decides as the API or CLI authenticated them (see Attestation).
    attested_by: Attestation | None = None
    subject_field: ClassVar[str] = "decided_by"

    def attested_fields(self) -> dict[str, Any]:
        """What an attestation covers: everything that says who decided what."""
        return {
            "kind": "decision",
            "approval_id": self.approval_id,
            "decision": self.decision,
            "request_id": self.request_id,
            "decided_by": self.decided_by,
            "reason": self.reason,
            "arguments_digest": self.arguments_digest,
            "edits": canonical_digest(self.arguments),
        }

    @model_validator(mode="after")
    def _edits_only_when_approving(self) -> Decision:
        if self.arguments is not None and self.decision != "approved":
            raise ValueError("edited arguments come only with an approval")
        return self


# The name the typed client exported before: kept so callers' imports work.
DecisionInput = Decision


class RecordDecisionInput(Model):
    """What the decide activity needs to re-check edited arguments."""

    decision: Decision
    snapshot: CapabilitySnapshot | None = None
    write_policy: str = "confirm_all_writes"
    # What the run shows once the decision is recorded, set in the decision's
    # own transaction (workflows/status.py); None: the workflow publishes it.
    run_status: str | None = None
    # The id of the update that asked (None for a signal): the decision (or
    # the edit) is recorded under it, so an attempt retried after the first
    # one committed (a timeout cancelled it, its answer was lost) finds that
    # record instead of deciding again.
    request_key: str | None = None

    @model_serializer(mode="wrap")
    def _rollout(self, handler: Any) -> Any:
        return omitted_while_none(handler(self), "request_key")


class SignalSender(Model):
    """Which signal to attribute: the one with this name carrying exactly
    this payload (as JSON)."""

    workflow_id: str
    signal_name: str
    payload: dict[str, Any]


class DecisionRecorded(Model):
    approval_id: str
    action_id: str
    status: ActionStatus
    approval_status: ApprovalStatus
    expires_at: datetime | None = None  # the approval's deadline as it stands
    conflict: str | None = None
    edits: list[dict[str, Any]] | None = None
    # The run's status as the decision's transaction left it, when it was
    # asked to carry one (RecordDecisionInput.run_status).
    run_status: str | None = None


class ExtendInput(Model):
    approval_id: str
    seconds: int = Field(gt=0)
    extended_by: str = Field(min_length=1, max_length=255)
    max_seconds: int = Field(default=7 * 24 * 3600, gt=0)
    # Limits on repeated extensions; the worker's own settings bound them too.
    max_extensions: int | None = Field(default=None, ge=0)
    max_total_seconds: int | None = Field(default=None, gt=0)
    # Who extends, as the API or CLI authenticated them (see Attestation).
    attested_by: Attestation | None = None
    # Set by the workflow to the request of the update that asked (a caller's
    # is replaced): the extension is recorded under it, so an attempt retried
    # after the first one committed finds it instead of extending again. As
    # long as an update id may be (Temporal's 1,000): a longer cap made an
    # extension by a long id fail to reach its activity (the store hashes it).
    request_key: str | None = Field(default=None, max_length=1000)

    subject_field: ClassVar[str] = "extended_by"

    @model_serializer(mode="wrap")
    def _rollout(self, handler: Any) -> Any:
        return omitted_while_none(handler(self), "request_key")

    def attested_fields(self) -> dict[str, Any]:
        return {
            "kind": "extend",
            "approval_id": self.approval_id,
            "seconds": self.seconds,
            "extended_by": self.extended_by,
        }


class ExtendOutput(Model):
    approval_id: str
    expires_at: datetime


class ReconcileInput(Model):
    action_id: str
    outcome: Literal["succeeded", "failed"]
    request_id: str | None = Field(default=None, max_length=64)
    decided_by: str = Field(min_length=1, max_length=255)
    note: str | None = Field(default=None, max_length=2000)
    # The last moment, by the database's clock, it may be recorded: its
    # sender waits until then for an answer, so "not taken" is then true
    # (a request a worker takes later is refused; store/reconcile_requests.py).
    not_after: datetime | None = None
    # When it was asked, by the database's clock: a word given while the
    # attempt could still run is never taken (store/actions.py,
    # refuse_unreconcilable). Without it, the attestation's time stands in.
    asked_at: datetime | None = None
    # Reconciling is for operators: the server's word that this one is.
    attested_by: Attestation | None = None
    subject_field: ClassVar[str] = "decided_by"

    def attested_fields(self) -> dict[str, Any]:
        fields = {
            "kind": "reconcile",
            "action_id": self.action_id,
            "outcome": self.outcome,
            "request_id": self.request_id,
            "decided_by": self.decided_by,
            "note": self.note,
        }
        for name in ("not_after", "asked_at"):  # only when set: older attestations verify
            value = getattr(self, name)
            if value is not None:
                fields[name] = value.isoformat()
        return fields

    @model_serializer(mode="wrap")
    def _rollout(self, handler: Any) -> Any:
        return omitted_while_none(handler(self), "not_after", "asked_at")


class ReconcileRequest(Model):
    """A reconciliation made outside the run's workflow (which is closed, or
    not waiting on the action): done in the store by a short workflow."""

    run_id: str
    reconcile: ReconcileInput
    # The task queue of a tool worker serving the action's tool (worker
    # roles): it alone can fence the target. None: the workflow's own queue.
    tool_queue: str | None = None


class ReconcileOutput(Model):
    action_id: str
    status: ActionStatus
    conflict: str | None = None
    # Set when refused because the attempt may still run: when to try again.
    retry_at: datetime | None = None


class RunStatusInput(Model):
    run_id: str
    status: str
    failure: dict[str, str] | None = None  # {"code", "message"} when it failed


class RunStatusOutput(Model):
    run_id: str
    status: str


class ApprovalRef(Model):
    approval_id: str
    # For expiry: the deadline the workflow's timer was armed for.
    deadline: datetime | None = None


class ActionRef(Model):
    action_id: str


class CallRef(Model):
    """A write call by its idempotency key, whether or not it was recorded."""

    run_id: str
    idempotency_key: str


class RunState(Model):
    """The workflow's own view, served by the ``state`` query and carried
    through continue-as-new."""

    run_id: str = ""
    session_id: str = ""
    status: str = "pending"
    round: int = 0
    snapshot: CapabilitySnapshot | None = None
    threads: dict[str, list[ChatMessage]] = Field(default_factory=dict)
    transcript: list[ChatMessage] = Field(default_factory=list)
    pending_approvals: dict[str, PendingWrite] = Field(default_factory=dict)
    unknown_actions: dict[str, PendingWrite] = Field(default_factory=dict)
    final_answer: str | None = None
    usage: TokenUsage = Field(default_factory=TokenUsage)
    blocked_reason: str | None = None  # runs from before per-write reasons
    # Writes waiting for another action's reconciliation: action → why.
    blocked_writes: dict[str, str] = Field(default_factory=dict)
    webhook_urls: list[str] = Field(default_factory=list)
    expiring_lead_seconds: int = 300
    # Tools served by tool workers elsewhere (worker roles): the task queue
    # each one's calls go to. A tool not named here runs where the run does.
    tool_queues: dict[str, str] = Field(default_factory=dict)
    # Calls waiting for a tool worker (worker roles): call → why.
    unserved_calls: dict[str, str] = Field(default_factory=dict)
    # Whether a refresh signal makes this run re-read what it waits on from the
    # store (runs started before that rule ignore it: the sweep must not nudge
    # them over and over).
    reads_store_on_refresh: bool = False
    # The digest the store keeps the snapshot under, for the seat turns to
    # name (None: runs opened before snapshots were kept send the specs).
    snapshot_digest: str | None = None

    @model_serializer(mode="wrap")
    def _rollout(self, handler: Any) -> Any:
        return omitted_while_none(handler(self), "snapshot_digest")


class WorkflowArgs(Model):
    """The workflow's single argument: the request plus, after
    continue-as-new, the state it carries."""

    request: RunInput
    carried: RunState | None = None


class RunResult(Model):
    run_id: str
    status: str
    final_answer: str | None
    usage: TokenUsage
