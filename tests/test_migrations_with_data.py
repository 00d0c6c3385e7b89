"""Upgrades keep data: every migration, from every earlier revision, with rows
in every table, up to the head and back down, on SQLite and PostgreSQL.

The rows are made by reflection (a value of the right type for each column,
foreign keys pointing at the row seeded in the referenced table), so a table
added later is seeded without anyone remembering to extend this test.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.script import ScriptDirectory

from roundtable.store.engine import create_engine_for
from roundtable.store.migrate import alembic_config, downgrade_database, upgrade_database

REVISIONS = [
    script.revision
    for script in reversed(list(ScriptDirectory.from_config(alembic_config()).walk_revisions()))
]
SEED_ID = "seed-1"


def _value(column: sa.Column, table: str) -> Any:
    kind = column.type
    if isinstance(kind, sa.Boolean):
        return False
    if isinstance(kind, sa.Integer):  # BigInteger and SmallInteger too
        return 1
    if isinstance(kind, sa.DateTime):
        return datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    if isinstance(kind, sa.JSON) or kind.__class__.__name__ == "JSONB":
        return {"seeded": True}
    return f"{SEED_ID}-{table}-{column.name}"[: getattr(kind, "length", None) or 200]


def _seed(connection: sa.Connection) -> dict[str, int]:
    """One row in every table, parents first; returns the row counts."""
    metadata = sa.MetaData()
    metadata.reflect(connection)
    keys: dict[tuple[str, str], Any] = {}  # (table, column) → the seeded value
    for table in metadata.sorted_tables:
        if table.name == "alembic_version":
            continue
        row: dict[str, Any] = {}
        for column in table.columns:
            if (
                column.primary_key
                and column.autoincrement is True
                and isinstance(column.type, sa.Integer)
            ):
                continue
            foreign = next(iter(column.foreign_keys), None)
            if foreign is not None:
                row[column.name] = keys[(foreign.column.table.name, foreign.column.name)]
            else:
                row[column.name] = _value(column, table.name)
            keys[(table.name, column.name)] = row[column.name]
        connection.execute(table.insert().values(**row))
    return _counts(connection)


def _counts(connection: sa.Connection) -> dict[str, int]:
    metadata = sa.MetaData()
    metadata.reflect(connection)
    return {
        name: connection.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
        for name, table in metadata.tables.items()
        if name != "alembic_version"
    }


@pytest.mark.parametrize("start", REVISIONS)
async def test_upgrading_from_each_revision_keeps_every_row(database_url: str, start: str) -> None:
    engine = create_engine_for(database_url)
    try:
        await upgrade_database(engine, start)
        async with engine.begin() as connection:
            seeded = await connection.run_sync(_seed)
        assert seeded and all(count == 1 for count in seeded.values()), seeded

        await upgrade_database(engine, "head")
        async with engine.connect() as connection:
            after_upgrade = await connection.run_sync(_counts)
        assert {name: after_upgrade[name] for name in seeded} == seeded

        await downgrade_database(engine, start)
        async with engine.connect() as connection:
            after_downgrade = await connection.run_sync(_counts)
        assert after_downgrade == seeded  # back where we started, rows and all

        await upgrade_database(engine, "head")  # and up again
        async with engine.connect() as connection:
            again = await connection.run_sync(_counts)
        assert {name: again[name] for name in seeded} == seeded
    finally:
        await engine.dispose()
