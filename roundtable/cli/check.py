"""``roundtable check``: hold the store, the ticket log and Temporal to the
promise (roundtable/invariants.py). Run it when the system is quiet."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from roundtable.cli.output import EXIT_ERROR, emit, run_or_fail
from roundtable.cli.shared import JsonFlag, require_sqlite_file, settings, store_from, temporal
from roundtable.evidence import gather
from roundtable.invariants import check as find_violations
from roundtable.invariants import summary
from roundtable.tools.tickets import TicketSystem


def check(
    faults: Annotated[int, typer.Option(help="Faults injected, for the summary line.")] = 0,
    no_temporal: Annotated[
        bool, typer.Option("--no-temporal", help="Do not compare with Temporal.")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Check every invariant; exit 1 if any is violated."""

    async def look() -> dict[str, Any]:
        config = settings()
        client = None if no_temporal else await temporal(config)
        require_sqlite_file(config.database_url)
        require_sqlite_file(config.tickets_url())
        system = await TicketSystem.open(config.tickets_url())
        try:
            async with store_from(config) as store:
                evidence = await gather(store, system, client)
        finally:
            await system.close()
        violations = find_violations(evidence)
        return {
            "summary": summary(evidence, violations, faults),
            "violations": [
                {"rule": v.rule, "subject": v.subject, "message": v.message} for v in violations
            ],
        }

    found = run_or_fail(look(), as_json)
    human = "\n".join(
        [
            *(f"rule {v['rule']} · {v['subject']}: {v['message']}" for v in found["violations"]),
            found["summary"],
        ]
    )
    emit(found, as_json, human)
    if found["violations"]:
        raise typer.Exit(EXIT_ERROR)
