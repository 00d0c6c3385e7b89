"""Inbox sessions: the approvals inbox's sign-in (issue 15).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01

A browser signs in with an API token and then holds a session cookie. Only
the SHA-256 of the session id is stored; the CSRF token is derived from the
session id and not stored at all. A session acts with the token it was
opened with: revoking that token ends it.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "inbox_sessions",
        sa.Column("id_hash", sa.String(64), nullable=False),
        sa.Column("token_id", sa.String(64), nullable=False),
        sa.Column("user_id", sa.String(255), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id_hash", name="pk_inbox_sessions"),
        sa.ForeignKeyConstraint(
            ["token_id"],
            ["api_tokens.id"],
            name="fk_inbox_sessions_token_id_api_tokens",
        ),
    )
    op.create_index("ix_inbox_sessions_token_id", "inbox_sessions", ["token_id"])


def downgrade() -> None:
    op.drop_index("ix_inbox_sessions_token_id", table_name="inbox_sessions")
    op.drop_table("inbox_sessions")
