"""The ``roundtable`` command line.

Exit codes (stable, scripts depend on them): 0 done, 1 error, 2 usage,
3 conflict, 4 not found. Every command takes ``--json``.
"""

from __future__ import annotations

import sys

import typer

from roundtable.cli import db, operators, runs, stack

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
app.add_typer(db.app, name="db")
app.command()(runs.start)
app.command()(runs.show)
app.command()(operators.approvals)
app.command()(operators.approve)
app.command()(operators.reject)
app.command()(operators.reconcile)
app.command()(operators.tickets)
app.command()(stack.worker)
app.command()(stack.dev)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
