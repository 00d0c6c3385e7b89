"""Safety core: sessions, runs, actions, secrets, approvals, leases, fencing, audit.

Revision ID: 0001
Revises:
Create Date: 2026-11-30

Written by hand (not imported from the models) so that later model changes
cannot silently rewrite history; tests compare this schema with the models.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _timestamp(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _json(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(
        name, sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=nullable
    )


def _id(name: str = "id") -> sa.Column:
    return sa.Column(name, sa.String(64), nullable=False)


def _fk(column: str, table: str, owner: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint([column], [f"{table}.id"], name=f"fk_{owner}_{column}_{table}")


def upgrade() -> None:
    op.create_table(
        "sessions",
        _id(),
        sa.Column("user_id", sa.String(255), nullable=False),
        sa.Column("task_text", sa.Text(), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        sa.PrimaryKeyConstraint("id", name="pk_sessions"),
    )
    op.create_index("ix_sessions_user_id", "sessions", ["user_id"])

    op.create_table(
        "runs",
        _id(),
        _id("session_id"),
        sa.Column("user_id", sa.String(255), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("last_event_seq", sa.BigInteger(), nullable=False),
        sa.Column("last_event_hash", sa.String(64), nullable=False),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        sa.PrimaryKeyConstraint("id", name="pk_runs"),
        _fk("session_id", "sessions", "runs"),
    )
    op.create_index("ix_runs_session_id", "runs", ["session_id"])
    op.create_index("ix_runs_status", "runs", ["status"])
    op.create_index("ix_runs_user_id", "runs", ["user_id"])

    op.create_table(
        "actions",
        _id(),
        _id("session_id"),
        _id("run_id"),
        sa.Column("agent_id", sa.String(255), nullable=False),
        sa.Column("tool_name", sa.String(255), nullable=False),
        sa.Column("logical_action_id", sa.String(255), nullable=True),
        sa.Column("turn_index", sa.Integer(), nullable=True),
        sa.Column("risk_level", sa.String(8), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        _json("arguments"),
        _json("safe_argument_fields"),
        _json("result", nullable=True),
        sa.Column("external_object_id", sa.String(255), nullable=True),
        sa.Column("approval_id", sa.String(64), nullable=True),
        sa.Column("attempt_count", sa.Integer(), nullable=False),
        sa.Column("target_key", sa.String(128), nullable=False),
        sa.Column("idempotency_key", sa.String(255), nullable=False),
        sa.Column("fencing_token", sa.BigInteger(), nullable=True),
        _timestamp("started_at", nullable=True),
        _timestamp("finished_at", nullable=True),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        sa.PrimaryKeyConstraint("id", name="pk_actions"),
        sa.UniqueConstraint("idempotency_key", name="uq_actions_idempotency_key"),
        _fk("run_id", "runs", "actions"),
        _fk("session_id", "sessions", "actions"),
    )
    op.create_index("ix_actions_run_id", "actions", ["run_id"])
    op.create_index("ix_actions_target_key_status", "actions", ["target_key", "status"])

    op.create_table(
        "action_secrets",
        _id("action_id"),
        sa.Column("arguments_encrypted", sa.Text(), nullable=False),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("action_id", name="pk_action_secrets"),
        _fk("action_id", "actions", "action_secrets"),
    )

    op.create_table(
        "approvals",
        _id(),
        _id("action_id"),
        _id("run_id"),
        sa.Column("status", sa.String(32), nullable=False),
        _timestamp("expires_at"),
        sa.Column("decided_by", sa.String(255), nullable=True),
        sa.Column("decision_reason", sa.Text(), nullable=True),
        _timestamp("decided_at", nullable=True),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        sa.PrimaryKeyConstraint("id", name="pk_approvals"),
        _fk("action_id", "actions", "approvals"),
        _fk("run_id", "runs", "approvals"),
    )
    op.create_index("ix_approvals_action_id", "approvals", ["action_id"])
    op.create_index("ix_approvals_run_id", "approvals", ["run_id"])
    op.create_index("ix_approvals_status_expires_at", "approvals", ["status", "expires_at"])
    # At most one open question per action, enforced by the database.
    op.create_index(
        "uq_approvals_one_pending_per_action",
        "approvals",
        ["action_id"],
        unique=True,
        postgresql_where=sa.text("status = 'pending'"),
        sqlite_where=sa.text("status = 'pending'"),
    )

    op.create_table(
        "action_leases",
        sa.Column("target_key", sa.String(128), nullable=False),
        _id("action_id"),
        _id("run_id"),
        sa.Column("fencing_token", sa.BigInteger(), nullable=False),
        _timestamp("acquired_at"),
        _timestamp("lease_expires_at"),
        sa.PrimaryKeyConstraint("target_key", name="pk_action_leases"),
        sa.UniqueConstraint("action_id", name="uq_action_leases_action_id"),
        _fk("action_id", "actions", "action_leases"),
        _fk("run_id", "runs", "action_leases"),
    )
    op.create_index("ix_action_leases_lease_expires_at", "action_leases", ["lease_expires_at"])
    op.create_index("ix_action_leases_run_id", "action_leases", ["run_id"])

    op.create_table(
        "target_fencing",
        sa.Column("target_key", sa.String(128), nullable=False),
        sa.Column("last_token", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("target_key", name="pk_target_fencing"),
    )

    op.create_table(
        "audit_events",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        _id("run_id"),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("event_type", sa.String(64), nullable=False),
        _json("payload"),
        sa.Column("prev_hash", sa.String(64), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("id", name="pk_audit_events"),
        sa.UniqueConstraint("run_id", "seq", name="uq_audit_events_run_id_seq"),
        _fk("run_id", "runs", "audit_events"),
    )
    _make_audit_append_only()


def _make_audit_append_only() -> None:
    """The audit log refuses UPDATE and DELETE at the database, not just in code."""
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "CREATE FUNCTION roundtable_audit_append_only() RETURNS trigger "
            "LANGUAGE plpgsql AS $$ BEGIN "
            "RAISE EXCEPTION 'audit_events is append-only'; END $$"
        )
        op.execute(
            "CREATE TRIGGER audit_events_append_only BEFORE UPDATE OR DELETE ON audit_events "
            "FOR EACH ROW EXECUTE FUNCTION roundtable_audit_append_only()"
        )
        return
    for verb in ("UPDATE", "DELETE"):
        op.execute(
            f"CREATE TRIGGER audit_events_no_{verb.lower()} BEFORE {verb} ON audit_events "
            "BEGIN SELECT RAISE(ABORT, 'audit_events is append-only'); END"
        )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS audit_events_append_only ON audit_events")
        op.execute("DROP FUNCTION IF EXISTS roundtable_audit_append_only()")
    for table in (
        "audit_events",
        "target_fencing",
        "action_leases",
        "approvals",
        "action_secrets",
        "actions",
        "runs",
        "sessions",
    ):
        op.drop_table(table)
