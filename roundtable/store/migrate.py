"""Apply Alembic migrations (``roundtable db upgrade``, the worker, ``roundtable
dev``, or ``alembic``), and tell everyone else whether the schema is current."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from roundtable.store.errors import SchemaNewerError, SchemaOutOfDateError

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
# Any constant will do; two processes migrating one PostgreSQL database at
# start-up take turns instead of racing on the version table.
_MIGRATION_LOCK_ID = 0x526F756E64  # "Round"


def alembic_config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def _migrate(connection: Connection, direction: str, revision: str) -> None:
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": _MIGRATION_LOCK_ID})
    _refuse_newer(_current(connection))
    getattr(command, direction)(alembic_config(connection), revision)
    if connection.dialect.name == "sqlite":
        # Foreign keys were off while tables were rebuilt; prove nothing dangles.
        broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
        if broken:
            raise RuntimeError(f"migration left rows whose foreign keys dangle: {broken[:5]}")


def _sqlite_foreign_keys(connection: Connection, enforced: bool) -> None:
    """Straight on the driver's connection: SQLAlchemy would wrap it in a
    transaction, where SQLite ignores this pragma."""
    cursor = connection.connection.dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA foreign_keys={'ON' if enforced else 'OFF'}")
    finally:
        cursor.close()


async def _run_migration(engine: AsyncEngine, direction: str, revision: str) -> None:
    async with engine.connect() as connection:
        if connection.dialect.name == "sqlite":
            # SQLite changes most columns by copying the table into a new one
            # and dropping the old: with foreign keys enforced, DROP TABLE of a
            # table other rows point at fails. The pragma only takes effect
            # outside a transaction, so it is set before BEGIN.
            await connection.run_sync(_sqlite_foreign_keys, False)
        try:
            async with connection.begin():
                await connection.run_sync(_migrate, direction, revision)
        finally:
            if connection.dialect.name == "sqlite":
                await connection.run_sync(_sqlite_foreign_keys, True)


async def upgrade_database(engine: AsyncEngine, revision: str = "head") -> None:
    await _run_migration(engine, "upgrade", revision)


async def downgrade_database(engine: AsyncEngine, revision: str) -> None:
    await _run_migration(engine, "downgrade", revision)


def _current(connection: Connection) -> str | None:
    from alembic.runtime.migration import MigrationContext

    return MigrationContext.configure(connection).get_current_revision()


async def current_revision(engine: AsyncEngine) -> str | None:
    async with engine.connect() as connection:
        return await connection.run_sync(_current)


def _scripts() -> Any:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config())


def _known_revisions(scripts: Any = None) -> set[str]:
    return {script.revision for script in (scripts or _scripts()).walk_revisions()}


def head_revision(scripts: Any = None) -> str:
    head = (scripts or _scripts()).get_current_head()
    assert head is not None, "no migrations found"
    return head


def _refuse_newer(current: str | None, scripts: Any = None) -> None:
    """Alembic's own word for a revision it does not know is "Can't locate
    revision": say what it means, a newer release migrated the database."""
    scripts = scripts or _scripts()
    if current is not None and current not in _known_revisions(scripts):
        raise SchemaNewerError(current, head_revision(scripts))


async def require_current_schema(engine: AsyncEngine) -> None:
    """Refuse a database whose schema is not the one this code was written for
    (SchemaOutOfDateError): commands that only use the database never change
    its schema behind an operator's back."""
    current, scripts = await current_revision(engine), _scripts()
    _refuse_newer(current, scripts)
    head = head_revision(scripts)
    if current != head:
        raise SchemaOutOfDateError(current, head)
