"""The ``roundtable`` command line.

Exit codes (stable, scripts depend on them): 0 done, 1 error, 2 usage,
3 conflict, 4 not found. Every command takes ``--json``.
"""

from __future__ import annotations

import logging
import os
import sys

import typer

from roundtable.cli import check, db, operators, runs, stack, tokens
from roundtable.config import adopt_dev_secret

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
app.add_typer(db.app, name="db")
app.add_typer(tokens.app, name="tokens")
app.command()(runs.start)
app.command()(runs.show)
app.command()(operators.approvals)
app.command()(operators.approve)
app.command()(operators.reject)
app.command()(operators.reconcile)
app.command()(operators.tickets)
app.command()(check.check)
app.command()(stack.worker)
app.command()(stack.dev)
app.command()(stack.api)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def main() -> None:
    code = 1
    try:
        adopt_dev_secret()
        app()
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt:
        code = 130
    finally:
        # Leave without interpreter finalization: the Temporal SDK's native
        # threads can outlive the event loop, and CPython then aborts with
        # "PyGILState_Release ... finalizing" (temporalio/sdk-python#300),
        # turning a finished command into exit 134 about 1 time in 40 here.
        # Every command has closed its stores and clients by now.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
