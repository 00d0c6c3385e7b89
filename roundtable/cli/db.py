"""``roundtable db``: the schema."""

from __future__ import annotations

import asyncio

import typer

from roundtable.cli.output import CliError, emit, fail, safe_url
from roundtable.cli.shared import DatabaseUrl, JsonFlag
from roundtable.config import load_settings
from roundtable.store.engine import create_engine_for
from roundtable.store.errors import StoreError
from roundtable.store.migrate import current_revision, upgrade_database

app = typer.Typer(no_args_is_help=True, help="Database schema.")


async def upgrade(url: str) -> str | None:
    engine = create_engine_for(url)
    try:
        await upgrade_database(engine)
        return await current_revision(engine)
    finally:
        await engine.dispose()


@app.command("upgrade")
def db_upgrade(database_url: DatabaseUrl = None, as_json: JsonFlag = False) -> None:
    """Apply every pending migration."""
    url = database_url or load_settings().database_url
    try:
        revision = asyncio.run(upgrade(url))
    except StoreError as exc:
        fail(exc, as_json)
    except Exception as exc:  # a driver's or the network's error, told plainly
        fail(CliError(f"cannot migrate the database at {safe_url(url)}: {exc}"), as_json)
    emit({"revision": revision}, as_json, f"database at revision {revision}")
