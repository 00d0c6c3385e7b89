"""Alembic environment: migrations run on a connection handed in by
:mod:`roundtable.store.migrate` (async engines run them through ``run_sync``)."""

from __future__ import annotations

import asyncio

from alembic import context

from roundtable.config import load_settings
from roundtable.store.engine import create_engine_for
from roundtable.store.schema import Base

target_metadata = Base.metadata


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_standalone() -> None:
    engine = create_engine_for(
        context.config.get_main_option("sqlalchemy.url") or load_settings().database_url
    )
    async with engine.begin() as connection:
        await connection.run_sync(_run)
    await engine.dispose()


connection = context.config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    asyncio.run(_run_standalone())
