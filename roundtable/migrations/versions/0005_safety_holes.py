"""Closed runs say why, turns count once, large tool results live here.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30

- ``runs.failure``: why a run failed, was terminated or stalled ({code, message}).
- ``runs.request_fingerprint``: what an Idempotency-Key was first used for, so a
  replay is recognised whatever state (or retention) its workflow is in.
- ``audit_events.dedupe_key``: events a retried activity may append twice
  (a model turn's usage) carry a key unique within their run.
- ``tool_results``: results too large for workflow history, encrypted, by reference.

Columns are added with plain ALTER TABLE (no batch rebuild), so the audit
table keeps its append-only triggers on SQLite.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "runs",
        sa.Column(
            "failure", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=True
        ),
    )
    op.add_column("runs", sa.Column("request_fingerprint", sa.String(64), nullable=True))
    op.add_column("audit_events", sa.Column("dedupe_key", sa.String(255), nullable=True))
    op.create_index(
        "uq_audit_events_run_id_dedupe_key",
        "audit_events",
        ["run_id", "dedupe_key"],
        unique=True,
    )
    op.create_table(
        "tool_results",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("seat", sa.String(255), nullable=False),
        sa.Column("call_id", sa.String(255), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("content_encrypted", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_tool_results"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_tool_results_run_id_runs"),
    )
    op.create_index("ix_tool_results_run_id", "tool_results", ["run_id"])


def downgrade() -> None:
    op.drop_table("tool_results")
    op.drop_index("uq_audit_events_run_id_dedupe_key", table_name="audit_events")
    with op.batch_alter_table("audit_events", recreate="never") as batch:
        batch.drop_column("dedupe_key")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("request_fingerprint")
        batch.drop_column("failure")
