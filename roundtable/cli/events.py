"""``roundtable events``: a run's audit log, or, with --follow, its events
as they are written until the run ends (the API's event stream)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from roundtable.cli.endpoint import ApiToken, ApiTokenFile, ApiUrl
from roundtable.cli.operator import ask, operator
from roundtable.cli.output import emit, run_or_fail
from roundtable.cli.shared import JsonFlag


def line(event: dict[str, Any]) -> str:
    payload = json.dumps(event["payload"], separators=(",", ":"), ensure_ascii=False)
    return f"{event['seq']:>5}  {event['created_at']}  {event['event_type']}  {payload}"


def events(
    run_id: Annotated[str, typer.Argument(help="Run id.")],
    follow: Annotated[
        bool,
        typer.Option(
            "--follow",
            help="Keep printing events as they happen, until the run ends "
            "(with --json: one JSON document per event, a line each).",
        ),
    ] = False,
    api: ApiUrl = None,
    token: ApiToken = None,
    token_file: ApiTokenFile = None,
    as_json: JsonFlag = False,
) -> None:
    """A run's audit log, oldest first."""
    if follow:
        run_or_fail(_follow(run_id, (api, token, token_file), as_json), as_json)
        return

    found = ask((api, token, token_file), lambda ops: ops.events(run_id), as_json)
    emit(found, as_json, "\n".join(line(e) for e in found) or "(none)")


async def _follow(run_id: str, via: tuple[Any, Any, Any], as_json: bool) -> None:
    async with operator(*via) as ops:
        async for event in ops.follow(run_id):
            # Each event as it comes: a follower is read while the run goes on.
            typer.echo(json.dumps(event) if as_json else line(event))
