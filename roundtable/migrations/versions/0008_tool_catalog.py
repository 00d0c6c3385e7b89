"""The tool catalog: which tools the tool workers serve, and where.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01

With worker roles (README, "Worker roles"), workflow workers hold no tool
code: tool workers publish each tool's facts (its snapshot spec) and the task
queue that serves it, and runs pin their snapshot and route their tool calls
from here.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tool_catalog",
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("task_queue", sa.String(255), nullable=False),
        sa.Column("spec", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=False),
        sa.Column("published_by", sa.String(255), nullable=False),
        sa.Column("published_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("tool_catalog")
