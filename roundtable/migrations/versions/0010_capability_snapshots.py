"""Capability snapshots kept under their digest (issue 12).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03

A run is pinned to a capability snapshot by its sha256 (``runs.snapshot_digest``).
Runs opened under rules-as-of-2026-12 also keep the snapshot's body here, so a
seat's turn can name the digest instead of carrying its tool specs, each
turn, in the workflow's history. Many runs share one snapshot: one row each.
The body is the digested JSON text itself (ASCII), not a JSON column: the
store's JSON writer escapes NUL and turns whole floats such as 1e16 into
integers, and a body that reads back other than it was digested fails the
check every reader makes.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "capability_snapshots",
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("kept_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("digest", name="pk_capability_snapshots"),
    )


def downgrade() -> None:
    op.drop_table("capability_snapshots")
