"""An index on actions.status.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01

The metrics read how many actions are unknown every few seconds, from every
worker and API process; without an index that count scans every action ever
recorded.

On PostgreSQL a plain CREATE INDEX blocks writes to ``actions`` while it
builds, and migrations run in one transaction, where CONCURRENTLY cannot. On
a large table, build it first without blocking, and this step does nothing:

    CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_actions_status ON actions (status);
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_actions_status", "actions", ["status"], if_not_exists=True)


def downgrade() -> None:
    op.drop_index("ix_actions_status", table_name="actions")
