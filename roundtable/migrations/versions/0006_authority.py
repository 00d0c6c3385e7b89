"""What the server granted a run, and which tenants a token may act for.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30

- ``runs.granted_write_policy``: the write policy the API or CLI checked
  against the starter's ceiling. A run without one (started straight through
  Temporal) is held to the service ceiling by the worker.
- ``runs.started_by_role``: the role whose ceiling that check used.
- ``runs.tenants`` / ``api_tokens.tenants``: the tenants a run's writes and a
  token's decisions may name; NULL means every tenant.
- ``runs.snapshot_digest``: the capability snapshot the worker pinned the run
  to; a workflow carrying another one (forged) is refused.
- ``webhook_deliveries.delivery_id`` grows to 255 characters: event ids run to
  about 170, which PostgreSQL refused (SQLite rebuilds the table).

Plain ALTER TABLE ADD COLUMN, as in 0005, so SQLite's triggers stay.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _json() -> sa.types.TypeEngine:
    return sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.add_column("runs", sa.Column("granted_write_policy", sa.String(40), nullable=True))
    op.add_column("runs", sa.Column("started_by_role", sa.String(16), nullable=True))
    op.add_column("runs", sa.Column("tenants", _json(), nullable=True))
    op.add_column("runs", sa.Column("snapshot_digest", sa.String(64), nullable=True))
    with op.batch_alter_table("webhook_deliveries") as batch:
        batch.alter_column(
            "delivery_id",
            type_=sa.String(255),
            existing_type=sa.String(64),
            existing_nullable=False,
        )
    op.add_column("api_tokens", sa.Column("tenants", _json(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("webhook_deliveries") as batch:
        batch.alter_column(
            "delivery_id",
            type_=sa.String(64),
            existing_type=sa.String(255),
            existing_nullable=False,
        )
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("tenants")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("snapshot_digest")
        batch.drop_column("tenants")
        batch.drop_column("started_by_role")
        batch.drop_column("granted_write_policy")
