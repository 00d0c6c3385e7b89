"""Target scopes: namespace-wide writes exclude every write in their namespace.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

A namespace-wide target key (key fields unusable) must conflict with every
specific key of its namespace, not only with itself. Actions and leases learn
their scope; claims serialise briefly on a per-scope row.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _flag(name: str) -> sa.Column:
    return sa.Column(name, sa.Boolean(), nullable=False, server_default=sa.false())


def upgrade() -> None:
    with op.batch_alter_table("actions") as batch:
        batch.add_column(sa.Column("target_scope", sa.String(128), nullable=True))
        batch.add_column(_flag("target_namespace_wide"))
        batch.create_index("ix_actions_target_scope_status", ["target_scope", "status"])
    with op.batch_alter_table("action_leases") as batch:
        batch.add_column(sa.Column("scope_key", sa.String(128), nullable=True))
        batch.add_column(_flag("namespace_wide"))
        batch.create_index("ix_action_leases_scope_key", ["scope_key"])
    op.create_table(
        "target_scopes",
        sa.Column("scope_key", sa.String(128), nullable=False),
        sa.Column("claims", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("scope_key", name="pk_target_scopes"),
    )


def downgrade() -> None:
    op.drop_table("target_scopes")
    with op.batch_alter_table("action_leases") as batch:
        batch.drop_index("ix_action_leases_scope_key")
        batch.drop_column("namespace_wide")
        batch.drop_column("scope_key")
    with op.batch_alter_table("actions") as batch:
        batch.drop_index("ix_actions_target_scope_status")
        batch.drop_column("target_namespace_wide")
        batch.drop_column("target_scope")
