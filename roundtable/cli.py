"""The ``roundtable`` command line.

Exit codes (stable, scripts depend on them): 0 done, 1 error, 2 usage,
3 conflict, 4 not found.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Annotated

import typer
from sqlalchemy.engine import make_url

from roundtable.config import load_settings
from roundtable.store.engine import create_engine_for
from roundtable.store.errors import ConflictError, NotFoundError, StoreError
from roundtable.store.migrate import current_revision, upgrade_database

EXIT_ERROR, EXIT_USAGE, EXIT_CONFLICT, EXIT_NOT_FOUND = 1, 2, 3, 4

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
db_app = typer.Typer(no_args_is_help=True, help="Database schema.")
app.add_typer(db_app, name="db")

DatabaseUrl = Annotated[
    str | None,
    typer.Option("--database-url", help="Defaults to ROUNDTABLE_DATABASE_URL or the local SQLite."),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]


def _fail(error: Exception, as_json: bool) -> None:
    code = EXIT_ERROR
    if isinstance(error, NotFoundError):
        code = EXIT_NOT_FOUND
    elif isinstance(error, ConflictError):
        code = EXIT_CONFLICT
    kind = getattr(error, "code", "error")
    if as_json:
        typer.echo(json.dumps({"error": {"code": kind, "message": str(error)}}))
    else:
        typer.echo(f"error: {error}", err=True)
    raise typer.Exit(code)


async def _upgrade(url: str) -> str | None:
    engine = create_engine_for(url)
    try:
        await upgrade_database(engine)
        return await current_revision(engine)
    finally:
        await engine.dispose()


@db_app.command("upgrade")
def db_upgrade(database_url: DatabaseUrl = None, as_json: JsonFlag = False) -> None:
    """Apply every pending migration."""
    url = database_url or load_settings().database_url
    try:
        revision = asyncio.run(_upgrade(url))
    except StoreError as exc:
        _fail(exc, as_json)
    except Exception as exc:  # a driver's or the network's error, told plainly
        where = make_url(url).render_as_string(hide_password=True)
        _fail(RuntimeError(f"cannot migrate the database at {where}: {exc}"), as_json)
    if as_json:
        typer.echo(json.dumps({"revision": revision}))
    else:
        typer.echo(f"database at revision {revision}")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
