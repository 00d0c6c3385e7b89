"""What each route answers, as pydantic models: the OpenAPI document is built
from these, so it says what the API does. One family per resource.

Timestamps are ISO 8601 strings exactly as the views render them (so bodies
stay what clients already parse); ``arguments`` are always the redacted
public arguments.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

Timestamp = str  # ISO 8601 with offset, as rendered by the views
Base64 = Annotated[
    str,
    Field(
        pattern=r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$",
        max_length=262144,
    ),
]


class Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ----------------------------------------------------------------- problems


class FieldError(Model):
    field: str
    message: str


class ProblemDocument(Model):
    """RFC 9457 problem details with a stable ``code``."""

    model_config = ConfigDict(extra="allow")
    type: str
    title: str
    status: int
    code: str
    detail: str
    errors: list[FieldError] | None = Field(default=None, description="For 422: which inputs.")
    retry_at: Timestamp | None = Field(default=None, description="For attempt_may_be_running.")


# ----------------------------------------------------------------- runs


class RunStarted(Model):
    run_id: str
    workflow_id: str
    status: str


class RunSummary(Model):
    run_id: str
    user_id: str
    status: str
    created_at: Timestamp
    updated_at: Timestamp


NEXT_CURSOR = Field(description="Pass as cursor for the next page; null at the end.")


class RunPage(Model):
    items: list[RunSummary]
    next_cursor: str | None = NEXT_CURSOR


class Failure(Model):
    code: str
    message: str


class Usage(Model):
    turns: int
    prompt_tokens: int
    completion_tokens: int


class ActionView(Model):
    id: str
    session_id: str
    run_id: str
    agent_id: str
    tool_name: str
    logical_action_id: str | None
    turn_index: int | None
    risk_level: str
    status: str
    arguments: dict[str, Any] | None = Field(description="Redacted: safe fields only.")
    result: dict[str, Any] | None
    external_object_id: str | None
    approval_id: str | None
    attempt_count: int | None
    started_at: Timestamp | None
    finished_at: Timestamp | None
    created_at: Timestamp
    updated_at: Timestamp


class ApprovalView(Model):
    id: str
    run_id: str
    action_id: str
    status: str
    expires_at: Timestamp
    decided_by: str | None
    decision_reason: str | None
    decided_at: Timestamp | None
    created_at: Timestamp
    updated_at: Timestamp
    tool_name: str
    agent_id: str
    arguments: dict[str, Any] | None = Field(description="Redacted: safe fields only.")
    arguments_digest: str | None = Field(description="Send it back with your decision.")


class ApprovalPage(Model):
    items: list[ApprovalView]
    next_cursor: str | None = NEXT_CURSOR


class RunView(Model):
    run_id: str
    user_id: str
    status: str
    failure: Failure | None
    usage: Usage
    created_at: Timestamp
    updated_at: Timestamp
    actions: list[ActionView]
    approvals: list[ApprovalView]


class EventView(Model):
    seq: int
    event_type: str
    payload: dict[str, Any]
    created_at: Timestamp
    hash: str


class EventPage(Model):
    items: list[EventView]
    next_cursor: str | None = NEXT_CURSOR


# ----------------------------------------------------------------- approvals and actions


class DecisionResult(Model):
    approval_id: str
    run_id: str
    action_id: str
    status: str


class ExtendResult(Model):
    approval_id: str
    run_id: str
    expires_at: Timestamp


class ReconcileResult(Model):
    action_id: str
    run_id: str
    status: str
    via: str = Field(description="'workflow' or 'store'.")


class RecoverResult(Model):
    run_id: str
    reset_to_event: int = Field(
        description="The stalled execution's first task completion this code does not "
        "replay: the new execution runs again from there."
    )
    from_execution: str = Field(description="The stalled execution's Temporal run id.")
    execution: str = Field(description="The new execution's Temporal run id.")


# ----------------------------------------------------------------- webhooks, codec, health


class WebhookDelivery(Model):
    id: int
    delivery_id: str
    run_id: str | None
    event_type: str
    url: str
    attempt: int
    status_code: int | None
    error: str | None
    delivered: bool
    created_at: Timestamp


class WebhookDeliveryPage(Model):
    items: list[WebhookDelivery]
    next_cursor: str | None = NEXT_CURSOR


class Payload(Model):
    """A Temporal Payload as proto-JSON (bytes as base64)."""

    model_config = ConfigDict(extra="allow")
    metadata: dict[str, str] = Field(default_factory=dict)
    data: str | None = None


class Payloads(Model):
    payloads: list[Payload] = Field(default_factory=list)


class PayloadIn(Model):
    """What the codec endpoints read: protobuf refuses any other field."""

    model_config = ConfigDict(extra="forbid")
    metadata: dict[str, Base64] = Field(default_factory=dict)
    data: Base64 = ""


class PayloadsIn(Model):
    model_config = ConfigDict(extra="forbid")
    payloads: list[PayloadIn] = Field(default_factory=list)


class Health(Model):
    status: str


class Readiness(Model):
    status: str = Field(description="'ready' or 'not_ready'.")
    checks: dict[str, str]
