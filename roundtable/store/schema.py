"""Tables. Alembic migrations are the source of truth for the live schema;
these models mirror them for queries (a test compares the two)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes in and out, on PostgreSQL (timestamptz) and SQLite (text).

    SQLite keeps naive text, so everything is normalised to UTC before storing;
    string comparison then orders correctly.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetimes are ambiguous; pass an aware datetime")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


JSONValue = JSON().with_variant(JSONB(), "postgresql")

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class SessionRow(Base):
    __tablename__ = "sessions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    user_id: Mapped[str] = mapped_column(String(255), index=True)
    task_text: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class RunRow(Base):
    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"), index=True)
    user_id: Mapped[str] = mapped_column(String(255), index=True)
    status: Mapped[str] = mapped_column(String(32), index=True)
    # The audit chain's head lives on the run row: appending an event updates
    # it, which also serialises every transition of one run.
    last_event_seq: Mapped[int] = mapped_column(BigInteger, default=0)
    last_event_hash: Mapped[str] = mapped_column(String(64))
    # Why the run failed, was terminated or is stalled: {"code", "message"}.
    failure: Mapped[dict[str, Any] | None] = mapped_column(JSONValue)
    # What an Idempotency-Key was first used for (sha256 of the request).
    request_fingerprint: Mapped[str | None] = mapped_column(String(64))
    # What the API or CLI allowed (see roundtable/permissions.py): the write
    # policy it checked, against whose ceiling, and the tenants the run may touch.
    granted_write_policy: Mapped[str | None] = mapped_column(String(40))
    started_by_role: Mapped[str | None] = mapped_column(String(16))
    tenants: Mapped[list[str] | None] = mapped_column(JSONValue)
    # The capability snapshot the worker pinned the run to (sha256).
    snapshot_digest: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class ActionRow(Base):
    __tablename__ = "actions"
    __table_args__ = (
        Index("ix_actions_target_key_status", "target_key", "status"),
        Index("ix_actions_target_scope_status", "target_scope", "status"),
        # The metrics count unknown actions every few seconds (0007).
        Index("ix_actions_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"))
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    agent_id: Mapped[str] = mapped_column(String(255))
    tool_name: Mapped[str] = mapped_column(String(255))
    logical_action_id: Mapped[str | None] = mapped_column(String(255))
    turn_index: Mapped[int | None] = mapped_column(Integer)
    risk_level: Mapped[str] = mapped_column(String(8))
    status: Mapped[str] = mapped_column(String(32))
    # Redacted view only; the full arguments live encrypted in action_secrets.
    arguments: Mapped[dict[str, Any]] = mapped_column(JSONValue)
    safe_argument_fields: Mapped[list[str]] = mapped_column(JSONValue)
    # HMAC of the full arguments: what an approver's decision is bound to.
    arguments_digest: Mapped[str | None] = mapped_column(String(80))
    result: Mapped[dict[str, Any] | None] = mapped_column(JSONValue)
    external_object_id: Mapped[str | None] = mapped_column(String(255))
    approval_id: Mapped[str | None] = mapped_column(String(64))
    attempt_count: Mapped[int] = mapped_column(Integer, default=0)
    target_key: Mapped[str] = mapped_column(String(128))
    # The key's namespace, when known; a namespace-wide key conflicts with
    # every key of its scope (see execution.py).
    target_scope: Mapped[str | None] = mapped_column(String(128))
    target_namespace_wide: Mapped[bool] = mapped_column(
        Boolean, default=False, server_default=false()
    )
    idempotency_key: Mapped[str] = mapped_column(String(255), unique=True)
    fencing_token: Mapped[int | None] = mapped_column(BigInteger)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class ActionSecretRow(Base):
    __tablename__ = "action_secrets"

    action_id: Mapped[str] = mapped_column(ForeignKey("actions.id"), primary_key=True)
    arguments_encrypted: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class ApprovalRow(Base):
    __tablename__ = "approvals"
    __table_args__ = (
        Index("ix_approvals_status_expires_at", "status", "expires_at"),
        Index(
            "uq_approvals_one_pending_per_action",
            "action_id",
            unique=True,
            postgresql_where=text("status = 'pending'"),
            sqlite_where=text("status = 'pending'"),
        ),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    action_id: Mapped[str] = mapped_column(ForeignKey("actions.id"), index=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    status: Mapped[str] = mapped_column(String(32))
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
    decided_by: Mapped[str | None] = mapped_column(String(255))
    decision_reason: Mapped[str | None] = mapped_column(Text)
    decided_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class ActionLeaseRow(Base):
    """One row per target: the primary key is what serialises writers.

    A row exists while its action is executing or unknown; it is removed only
    by a definite result or an operator's reconciliation, never by expiry.
    """

    __tablename__ = "action_leases"

    target_key: Mapped[str] = mapped_column(String(128), primary_key=True)
    action_id: Mapped[str] = mapped_column(ForeignKey("actions.id"), unique=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    fencing_token: Mapped[int] = mapped_column(BigInteger)
    acquired_at: Mapped[datetime] = mapped_column(UTCDateTime())
    lease_expires_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    scope_key: Mapped[str | None] = mapped_column(String(128), index=True)
    namespace_wide: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class TargetScopeRow(Base):
    """One row per scope. Claims in a scope update it first, which serialises
    the check "is anything in my scope in the way?" with the insert after it."""

    __tablename__ = "target_scopes"

    scope_key: Mapped[str] = mapped_column(String(128), primary_key=True)
    claims: Mapped[int] = mapped_column(BigInteger)


class TargetFencingRow(Base):
    """Per-target counter; never deleted, so tokens only ever grow."""

    __tablename__ = "target_fencing"

    target_key: Mapped[str] = mapped_column(String(128), primary_key=True)
    last_token: Mapped[int] = mapped_column(BigInteger)


class AuditEventRow(Base):
    __tablename__ = "audit_events"
    __table_args__ = (
        UniqueConstraint("run_id", "seq"),
        Index("uq_audit_events_run_id_dedupe_key", "run_id", "dedupe_key", unique=True),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True
    )
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"))
    seq: Mapped[int] = mapped_column(BigInteger)
    event_type: Mapped[str] = mapped_column(String(64))
    payload: Mapped[dict[str, Any]] = mapped_column(JSONValue)
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64))
    # Set on events a retried activity could append twice; unique per run.
    dedupe_key: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class ToolResultRow(Base):
    """A tool result too large for workflow history: kept here, encrypted
    (bound to its id), and handed to the workflow as a reference."""

    __tablename__ = "tool_results"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    seat: Mapped[str] = mapped_column(String(255))
    call_id: Mapped[str] = mapped_column(String(255))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    content_encrypted: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class ApiTokenRow(Base):
    """A bearer token, stored only as its SHA-256 (tokens are 256-bit random,
    so a fast hash is enough); the prefix lets people tell tokens apart."""

    __tablename__ = "api_tokens"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    token_prefix: Mapped[str] = mapped_column(String(16))
    user_id: Mapped[str] = mapped_column(String(255))
    role: Mapped[str] = mapped_column(String(16))
    label: Mapped[str | None] = mapped_column(String(255))
    # The tenants a user token acts for; NULL: every tenant.
    tenants: Mapped[list[str] | None] = mapped_column(JSONValue)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class WebhookDeliveryRow(Base):
    """One attempt to deliver one webhook event to one URL."""

    __tablename__ = "webhook_deliveries"

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True
    )
    # "<run id>:<event type>:<subject id>": up to about 170 characters.
    delivery_id: Mapped[str] = mapped_column(String(255), index=True)
    run_id: Mapped[str | None] = mapped_column(String(64), index=True)
    event_type: Mapped[str] = mapped_column(String(64))
    url: Mapped[str] = mapped_column(Text)
    attempt: Mapped[int] = mapped_column(Integer)
    status_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    delivered: Mapped[bool] = mapped_column(Boolean)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class ToolCatalogRow(Base):
    """A tool a tool worker serves, as it published it: the facts a run's
    snapshot pins (no code) and the task queue its calls go to. Workflow
    workers, which hold no tool code, build snapshots and routes from here."""

    __tablename__ = "tool_catalog"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    task_queue: Mapped[str] = mapped_column(String(255))
    spec: Mapped[dict[str, Any]] = mapped_column(JSONValue)
    published_by: Mapped[str] = mapped_column(String(255))
    published_at: Mapped[datetime] = mapped_column(UTCDateTime())


class CapabilitySnapshotRow(Base):
    """A capability snapshot runs were pinned to, kept under its digest (the
    sha256 ``runs.snapshot_digest`` holds). A seat's turn names the digest
    instead of carrying its tool specs in the history; the worker that runs
    the turn reads them from here. Written once, never changed: the digest
    is of this very body, kept as the JSON text that was digested (ASCII),
    since the JSON columns' writer changes some values (NUL, 1e16)."""

    __tablename__ = "capability_snapshots"

    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    body: Mapped[str] = mapped_column(Text)
    kept_at: Mapped[datetime] = mapped_column(UTCDateTime())


class InboxSessionRow(Base):
    """A signed-in inbox page (issue 15). Only the session id's hash is kept;
    the session acts with the API token it was opened with, so revoking that
    token ends the session too."""

    __tablename__ = "inbox_sessions"

    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    token_id: Mapped[str] = mapped_column(ForeignKey("api_tokens.id"), index=True)
    user_id: Mapped[str] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
