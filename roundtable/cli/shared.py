"""Options and connections every command shares."""

from __future__ import annotations

import getpass
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated

import typer
from sqlalchemy.engine import make_url
from temporalio.client import Client

from roundtable.cli.output import EXIT_NOT_FOUND, CliError
from roundtable.config import Settings, load_settings
from roundtable.store import SchemaOutOfDateError, Store, open_store
from roundtable.temporal import TemporalSettingsError, connect

JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
DatabaseUrl = Annotated[
    str | None,
    typer.Option("--database-url", help="Defaults to ROUNDTABLE_DATABASE_URL or the local SQLite."),
]
Actor = Annotated[str | None, typer.Option("--by", help="Who decides (default: cli:<login name>).")]


def actor(name: str | None) -> str:
    return name or f"cli:{getpass.getuser()}"


def require_sqlite_file(database_url: str) -> None:
    """A SQLite database that does not exist is reported, never created: run
    from another directory, the default path (relative to it) once made an
    empty database there and then said its schema was missing."""
    url = make_url(database_url)
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return
    path = Path(url.database).expanduser()
    if not path.exists():
        raise CliError(
            f"no Roundtable database at {path.resolve()}: run from the directory where "
            "`roundtable dev` runs, or set ROUNDTABLE_DATABASE_URL "
            "(`roundtable db upgrade` creates a new one)",
            "no_database",
            EXIT_NOT_FOUND,
        )


@asynccontextmanager
async def store_from(settings: Settings) -> AsyncIterator[Store]:
    """The store, if it exists and its schema is current: only `roundtable db
    upgrade` (and the worker, and `roundtable dev`) create it or change it."""
    require_sqlite_file(settings.database_url)
    try:
        pool = settings.database_pool()
        async with open_store(settings.database_url, migrate=False, pool=pool) as store:
            yield store
    except SchemaOutOfDateError as exc:
        raise CliError(str(exc), "schema_out_of_date") from exc


async def temporal(settings: Settings) -> Client:
    try:
        return await connect(settings)
    except TemporalSettingsError as exc:
        raise CliError(str(exc), "bad_settings") from None
    except Exception as exc:
        raise CliError(
            f"cannot reach Temporal at {settings.temporal_address}: {exc}", "unreachable"
        ) from exc


def settings() -> Settings:
    return load_settings()
