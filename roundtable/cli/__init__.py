"""The ``roundtable`` command line.

Exit codes (stable, scripts depend on them): 0 done, 1 error, 2 usage,
3 conflict, 4 not found. Every command takes ``--json``.
"""

from __future__ import annotations

import json
import sys

import typer

from roundtable.cli import check, db, events, operators, runs, stack, tokens
from roundtable.cli.output import EXIT_USAGE
from roundtable.config import adopt_dev_secret
from roundtable.process_exit import leave

HELP = (
    "Start, watch and decide Roundtable runs.\n\n"
    "Exit codes (stable; scripts depend on them): 0 done, 1 error, 2 usage, "
    "3 conflict, 4 not found. Commands that answer take --json: one JSON document "
    "on stdout, errors included."
)

# Plain help (no Rich): Rich's tables printed a type after every flag
# ("--json <bool>") and drew boxes that scripts and pagers mangle.
app = typer.Typer(no_args_is_help=True, add_completion=True, help=HELP, rich_markup_mode=None)
app.add_typer(db.app, name="db")
app.add_typer(tokens.app, name="tokens")
app.command()(runs.start)
app.command()(runs.show)
app.command("runs")(runs.list_runs)
app.command()(events.events)
app.command()(operators.approvals)
app.command()(operators.approve)
app.command()(operators.reject)
app.command()(operators.reconcile)
app.command()(operators.recover)
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


def _wants_json(args: list[str]) -> bool:
    """Whether --json was asked for, read before parsing: a usage error is
    found while parsing, and must still keep the one-document promise."""
    return "--json" in (args[: args.index("--")] if "--" in args else args)


def _usage_failure(exc: typer.TyperException, args: list[str]) -> int:
    """Click's own errors (a missing option, an unknown command, a bad number)."""
    code = getattr(exc, "exit_code", 1)
    if not _wants_json(args):
        show = getattr(exc, "show", None)
        if show is not None:
            show()
        else:
            print(f"Error: {exc.format_message()}", file=sys.stderr)
        return code
    message = exc.format_message()
    context = getattr(exc, "ctx", None)
    if context is not None:
        message = f"{message.rstrip('.')}; see `{context.command_path} --help`"
    if code == EXIT_USAGE and not message.strip():
        message = "no command given (see `roundtable --help`)"
    kind = "usage" if code == EXIT_USAGE else "error"
    print(json.dumps({"error": {"code": kind, "message": message}}))
    return code


def run(args: list[str]) -> int:
    """Parse and run one command line; its exit code."""
    command = typer.main.get_command(app)
    try:
        result = command.main(args=args, prog_name="roundtable", standalone_mode=False)
    except typer.TyperException as exc:
        return _usage_failure(exc, args)
    except typer.Abort:
        print("Aborted!", file=sys.stderr)
        return 1
    return result if isinstance(result, int) else 0


def main() -> None:
    code = 1
    try:
        adopt_dev_secret()
        code = run(sys.argv[1:])
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt:
        code = 130
    finally:
        leave(code)  # every command has closed its stores and clients by now
