"""Printing and failing, the same way for every command.

Exit codes (stable; scripts depend on them): 0 done, 1 error, 2 usage,
3 conflict, 4 not found. With ``--json`` stdout carries exactly one JSON
document, errors included; human messages go to stderr.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine, Sequence
from datetime import datetime
from typing import Any, NoReturn, TypeVar

import typer
from sqlalchemy.engine import make_url

from roundtable.operations import TemporalUnavailableError, WorkflowStalledError
from roundtable.store.errors import (
    ConflictError,
    ForbiddenError,
    InvalidInputError,
    NotFoundError,
)

T = TypeVar("T")

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_CONFLICT, EXIT_NOT_FOUND = 0, 1, 2, 3, 4


class CliError(Exception):
    """An error as the CLI reports it. ``fields`` go into the JSON error
    document beside ``code`` and ``message`` (e.g. the ``run_id`` of a run
    that was started before the command failed)."""

    def __init__(
        self,
        message: str,
        code: str = "error",
        exit_code: int = EXIT_ERROR,
        **fields: Any,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.exit_code = exit_code
        self.fields = fields


def usage_error(message: str) -> CliError:
    return CliError(message, "usage", EXIT_USAGE)


def conflict(message: str) -> CliError:
    return CliError(message, "conflict", EXIT_CONFLICT)


def as_cli_error(error: Exception) -> CliError:
    if isinstance(error, CliError):
        return error
    if isinstance(error, NotFoundError):
        return CliError(str(error), "not_found", EXIT_NOT_FOUND)
    if isinstance(error, ConflictError):
        return CliError(str(error), error.code, EXIT_CONFLICT)
    if isinstance(error, InvalidInputError):
        return CliError(
            str(error), "usage" if error.code == "invalid_input" else error.code, EXIT_USAGE
        )
    if isinstance(error, ForbiddenError):
        return CliError(str(error), error.code)
    if isinstance(error, WorkflowStalledError):  # Temporal answered: the run takes nothing now
        return CliError(str(error), error.code)
    if isinstance(error, TemporalUnavailableError):
        return CliError(str(error), "unreachable")
    return CliError(str(error) or type(error).__name__)


def fail(error: Exception, as_json: bool) -> NoReturn:
    problem = as_cli_error(error)
    if as_json:
        document = {**problem.fields, "code": problem.code, "message": str(problem)}
        typer.echo(json.dumps({"error": document}))
    else:
        typer.echo(f"error: {problem}", err=True)
    raise typer.Exit(problem.exit_code)


def run_or_fail(work: Coroutine[Any, Any, T], as_json: bool) -> T:
    """Run a command's work; any error leaves with its stable exit code."""
    try:
        return asyncio.run(work)
    except Exception as exc:
        fail(exc, as_json)


def _plain(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


def emit(document: Any, as_json: bool, human: str | None = None) -> None:
    if as_json:
        typer.echo(json.dumps(document, default=_plain))
    elif human is not None:
        typer.echo(human)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    if not rows:
        return "(none)"
    cells = [
        [str(_plain(row.get(c)) if row.get(c) is not None else "-") for c in columns]
        for row in rows
    ]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def safe_url(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)
